"""Prefill/decode servers over a device link (``serve --kv-role prefill|decode --kv-link
HOST:PORT``, gloo on CPU): no shared folder; the prefill server's prompt blocks go to the
decode server's landing slots, completions through ``pd-proxy`` equal one server's, and the
decode server loads every usable prompt block from the link."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")

from served_app import free_port  # noqa: E402
from test_pd_serve import PROMPTS, _body, _command, _text, _up, _want  # noqa: E402

from deepinfer_kit import LLM  # noqa: E402

POOL = dict(num_blocks=256, block_size=8, max_model_len=256, max_num_seqs=16)
POOL_ARGS = ["--model", "tiny", "--num-blocks", "256", "--block-size", "8", "--max-model-len", "256",
             "--max-num-seqs", "16"]


@contextlib.contextmanager
def _running(commands: list[list[str]], urls: list[str]) -> Iterator[None]:
    """The commands as processes, each up at its URL, for the block; then stopped."""
    procs = [_command(*c) for c in commands]
    try:
        for proc, url in zip(procs, urls):
            _up(proc, url)
        yield
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)


def _metric(url: str, name: str, medium: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if s.name == name and s.labels.get("medium", s.labels.get("kind")) == medium:
                return float(s.value)
    raise AssertionError(f"{name}{{medium={medium}}} not on {url}/metrics")


def test_servers_over_a_device_link_give_one_servers_tokens() -> None:
    reference = LLM("tiny", **POOL)  # type: ignore[arg-type]
    ports = [free_port() for _ in range(4)]
    urls = [f"http://127.0.0.1:{p}" for p in ports[:3]]
    link = f"127.0.0.1:{ports[3]}"
    commands = [["serve", "--port", str(ports[0]), "--kv-role", "prefill", "--kv-link", link, *POOL_ARGS],
                ["serve", "--port", str(ports[1]), "--kv-role", "decode", "--kv-link", link, *POOL_ARGS],
                ["pd-proxy", "--port", str(ports[2]), "--prefill", urls[0], "--decode", urls[1]]]
    with _running(commands, urls):
        for i in (1, 2, 4):
            for stream in (False, True):
                r = httpx.post(urls[2] + "/v1/completions", json=_body(i, stream), timeout=60)
                assert r.status_code == 200 and _text(r, stream) == _want(reference, i)
        stats: dict[str, Any] = httpx.get(urls[2] + "/proxy/stats").json()
        assert stats["fallbacks"] == 0
        usable = sum((len(PROMPTS[i]) - 1) // 8 for i in (1, 2, 4))
        # each prompt's blocks land once; its second request finds them in the decode pool
        assert _metric(urls[1], "deepinfer_kv_tier_hits_total", "host") == usable
        direct = httpx.post(urls[0] + "/v1/completions", json={"model": "tiny", "prompt": PROMPTS[3], "max_tokens": 9},
                            timeout=60).json()
        assert direct["usage"]["completion_tokens"] == 1
        assert direct["kv_transfer_params"]["remote_blocks"] == (len(PROMPTS[3]) - 1) // 8
        link = direct["kv_transfer_params"]["remote_link"]  # the proxy forwards it; the decode server checks it
        assert isinstance(link, str) and len(link) == 16


@pytest.mark.parametrize("argv, said", [
    (["--kv-link", "127.0.0.1:1"], "--kv-link needs --kv-role"),
    (["--kv-role", "decode", "--kv-link", "127.0.0.1:1", "--kv-tiers", '{"host_blocks": 4}'], "without --kv-tiers"),
    (["--kv-role", "decode", "--kv-link", "no-port"], "HOST:PORT"),
    (["--kv-role", "decode", "--kv-link", "127.0.0.1:1", "--kv-link-size", "1"], "--kv-link-size"),
    (["--kv-role", "decode", "--kv-link", "127.0.0.1:1", "--kv-link-rank", "0"], "the decode server is rank 1"),
    (["--kv-role", "prefill", "--kv-link", "127.0.0.1:1", "--kv-link-size", "3", "--kv-link-rank", "2"],
     "prefill servers ranks 0..1"),
])
def test_a_bad_kv_link_is_refused_before_any_connection(argv: list[str], said: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from deepinfer_kit.cli import main

    assert main(["serve", "--model", "tiny", *argv]) == 2
    assert said in capsys.readouterr().err


@pytest.mark.slow  # five processes: the one-pair test above covers the default tier's link path
def test_two_linked_pairs_behind_one_proxy_each_decode_the_prompts_their_prefill_sent() -> None:
    reference = LLM("tiny", **POOL)  # type: ignore[arg-type]
    ports = [free_port() for _ in range(7)]
    urls = [f"http://127.0.0.1:{p}" for p in ports[:5]]
    links = [f"127.0.0.1:{ports[5]}", f"127.0.0.1:{ports[6]}"]
    commands = [["serve", "--port", str(ports[0]), "--kv-role", "prefill", "--kv-link", links[0], *POOL_ARGS],
                ["serve", "--port", str(ports[1]), "--kv-role", "prefill", "--kv-link", links[1], *POOL_ARGS],
                ["serve", "--port", str(ports[2]), "--kv-role", "decode", "--kv-link", links[1], *POOL_ARGS],
                ["serve", "--port", str(ports[3]), "--kv-role", "decode", "--kv-link", links[0], *POOL_ARGS],
                ["pd-proxy", "--port", str(ports[4]), "--prefill", urls[0], "--prefill", urls[1],
                 "--decode", urls[2], "--decode", urls[3]]]
    with _running(commands, urls):
        own = {httpx.get(u + "/kv_link").json()["link"] for u in urls[:4]}
        assert len(own) == 2 and None not in own  # two links, each known to both its servers
        for i in range(4):  # prefill servers in turn: each answer names its own link
            r = httpx.post(urls[4] + "/v1/completions", json=_body(i, False), timeout=60)
            assert r.status_code == 200 and _text(r, False) == _want(reference, i)
        usable = [(len(PROMPTS[i]) - 1) // 8 for i in range(4)]
        # the pair on links[0] served prompts 0 and 2, the other 1 and 3: every block loaded, none waited for
        assert _metric(urls[3], "deepinfer_kv_tier_hits_total", "host") == usable[0] + usable[2]
        assert _metric(urls[2], "deepinfer_kv_tier_hits_total", "host") == usable[1] + usable[3]
        for url in urls[2:4]:
            assert _metric(url, "deepinfer_kv_tier_failures_total", "late_read") == 0


def test_the_proxy_sends_a_prefill_answer_to_a_decode_server_on_the_link_it_names() -> None:
    import asyncio
    import itertools

    from deepinfer_kit.serve.pd_proxy import DecodeLinks

    asked: list[str] = []
    said = {"http://a": {"role": "decode", "link": "aa"}, "http://b": {"role": "decode", "link": "bb"},
            "http://c": {"role": "decode", "link": None}}

    def answer(request: Any) -> Any:
        url = f"{request.url.scheme}://{request.url.host}"
        asked.append(url)
        if url == "http://d" and asked.count(url) == 1:
            return httpx.Response(503)  # starting: asked again next time
        return httpx.Response(200, json=said.get(url, {"role": "decode", "link": "dd"}))

    async def run() -> list[str]:
        urls = ["http://a", "http://b", "http://c", "http://d"]
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            links = DecodeLinks(client, urls, itertools.cycle(urls))
            return [await links.decode_for(x) for x in ("bb", "aa", "bb", None, "zz", "dd", "dd")]

    got = asyncio.run(run())
    assert got[:3] == ["http://b", "http://a", "http://b"]
    assert got[3:5] == ["http://a", "http://b"]  # no link named, or one no server is on: round robin
    assert got[5:] == ["http://d", "http://d"]  # d answered 503 first, and was asked again at the next answer
    assert asked.count("http://a") == 1 and asked.count("http://d") == 2  # a link, once read, is kept


@pytest.mark.slow  # four processes
def test_two_prefill_servers_feed_one_decode_server_on_one_link_group() -> None:
    reference = LLM("tiny", **POOL)  # type: ignore[arg-type]
    ports = [free_port() for _ in range(5)]
    urls = [f"http://127.0.0.1:{p}" for p in ports[:4]]
    group = ["--kv-link", f"127.0.0.1:{ports[4]}", "--kv-link-size", "3"]
    commands = [["serve", "--port", str(ports[0]), "--kv-role", "prefill", *group, "--kv-link-rank", "0", *POOL_ARGS],
                ["serve", "--port", str(ports[1]), "--kv-role", "prefill", *group, "--kv-link-rank", "1", *POOL_ARGS],
                ["serve", "--port", str(ports[2]), "--kv-role", "decode", *group, *POOL_ARGS],
                ["pd-proxy", "--port", str(ports[3]), "--prefill", urls[0], urls[1], "--decode", urls[2]]]
    with _running(commands, urls):
        said = [httpx.get(u + "/kv_link").json() for u in urls[:3]]
        assert said[2]["role"] == "decode" and sorted(said[2]["links"]) == sorted([said[0]["link"], said[1]["link"]])
        for i in range(4):  # the prefill servers in turn
            r = httpx.post(urls[3] + "/v1/completions", json=_body(i, False), timeout=60)
            assert r.status_code == 200 and _text(r, False) == _want(reference, i)
        usable = sum((len(PROMPTS[i]) - 1) // 8 for i in range(4))
        assert _metric(urls[2], "deepinfer_kv_tier_hits_total", "host") == usable  # from both links
        assert _metric(urls[2], "deepinfer_kv_tier_failures_total", "late_read") == 0
        for url in urls[:2]:
            assert _metric(url, "deepinfer_kv_tier_saved_total", "host") > 0  # each prefill server sent some
