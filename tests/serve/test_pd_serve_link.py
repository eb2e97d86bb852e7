"""Prefill/decode servers over a device link (``serve --kv-role prefill|decode --kv-link
HOST:PORT``, gloo on CPU): no shared folder; the prefill server's prompt blocks go to the
decode server's landing slots, completions through ``pd-proxy`` equal one server's, and the
decode server loads every usable prompt block from the link."""

from __future__ import annotations

from typing import Any

import pytest

httpx = pytest.importorskip("httpx")

from served_app import free_port  # noqa: E402
from test_pd_serve import PROMPTS, _body, _command, _text, _up, _want  # noqa: E402

from deepinfer_kit import LLM  # noqa: E402

POOL = dict(num_blocks=256, block_size=8, max_model_len=256, max_num_seqs=16)


def _metric(url: str, name: str, medium: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if s.name == name and s.labels.get("medium") == medium:
                return float(s.value)
    raise AssertionError(f"{name}{{medium={medium}}} not on {url}/metrics")


def test_servers_over_a_device_link_give_one_servers_tokens() -> None:
    reference = LLM("tiny", **POOL)  # type: ignore[arg-type]
    pool = ["--model", "tiny", "--num-blocks", "256", "--block-size", "8", "--max-model-len", "256",
            "--max-num-seqs", "16"]
    ports = [free_port() for _ in range(4)]
    urls = [f"http://127.0.0.1:{p}" for p in ports[:3]]
    link = f"127.0.0.1:{ports[3]}"
    procs = [_command("serve", "--port", str(ports[0]), "--kv-role", "prefill", "--kv-link", link, *pool),
             _command("serve", "--port", str(ports[1]), "--kv-role", "decode", "--kv-link", link, *pool),
             _command("pd-proxy", "--port", str(ports[2]), "--prefill", urls[0], "--decode", urls[1])]
    try:
        for proc, url in zip(procs, urls):
            _up(proc, url)
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
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)


@pytest.mark.parametrize("argv, said", [
    (["--kv-link", "127.0.0.1:1"], "--kv-link needs --kv-role"),
    (["--kv-role", "decode", "--kv-link", "127.0.0.1:1", "--kv-tiers", '{"host_blocks": 4}'], "without --kv-tiers"),
    (["--kv-role", "decode", "--kv-link", "no-port"], "HOST:PORT"),
])
def test_a_bad_kv_link_is_refused_before_any_connection(argv: list[str], said: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from deepinfer_kit.cli import main

    assert main(["serve", "--model", "tiny", *argv]) == 2
    assert said in capsys.readouterr().err
