"""Prefill/decode disaggregation across servers: ``serve --kv-role prefill|decode`` sharing a
KV folder, behind the ``pd-proxy``. Completions and chats through the proxy (streamed or
not, greedy and seeded) equal one server's; the decode server loads every full prompt
block the prefill server wrote; the prefill server answers only once the prompt is on
disk; a dead prefill server costs only the prefill."""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")

from served_app import App, free_port, uvicorn  # noqa: E402

from deepinfer_kit import LLM, SamplingParams  # noqa: E402
from deepinfer_kit.serve.pd_proxy import build_proxy_app  # noqa: E402
from deepinfer_kit.errors import ConfigError  # noqa: E402
from deepinfer_kit.serve import AsyncLLM  # noqa: E402
from deepinfer_kit.serve.options import ServeOptions  # noqa: E402

POOL = dict(num_blocks=256, block_size=8, max_model_len=256, max_num_seqs=16)
PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for j in range(20 + 9 * i)] for i in range(5)]


class Proxy:
    """The proxy app served by uvicorn on a thread."""

    def __init__(self, prefill: list[str], decode: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = build_proxy_app(prefill, decode)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "proxy did not start"
            time.sleep(0.02)

    @property
    def stats(self) -> Any:
        return self.app.state.stats

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class Pair:
    def __init__(self, folder: Path) -> None:
        tiers = {"host_blocks": 64, "disk_blocks": 1024, "disk_path": str(folder),
                 "hash_key": secrets.token_hex(32)}
        self.folder = folder
        self.prefill = App(ServeOptions(), kv_role="prefill", kv_tiers=tiers, **POOL)
        self.decode = App(ServeOptions(), kv_role="decode", kv_tiers=tiers, **POOL)
        self.proxy = Proxy([self.prefill.url], [self.decode.url])

    def disk_hits(self) -> int:
        return int(self.decode.llm.engine.cache.tier_stats.disk_hits)  # type: ignore[attr-defined]

    def stop(self) -> None:
        self.proxy.stop()
        self.prefill.stop()
        self.decode.stop()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    p = Pair(tmp_path_factory.mktemp("pd-kv"))
    yield p
    p.prefill.wait_idle()
    p.decode.wait_idle()
    p.stop()


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM("tiny", **POOL)


def _body(i: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "prompt": PROMPTS[i], "max_tokens": 6, "stream": stream}
    if i % 2:
        body.update(temperature=0.8, top_p=0.9, seed=40 + i)
    else:
        body["temperature"] = 0.0
    return body


def _want(reference: LLM, i: int) -> str:
    b = _body(i, False)
    params = SamplingParams(max_tokens=6, temperature=b["temperature"], top_p=b.get("top_p", 1.0), seed=b.get("seed"))
    return reference.generate([PROMPTS[i]], params)[0].outputs[0].text


def _text(r: Any, stream: bool) -> str:
    if not stream:
        return str(r.json()["choices"][0]["text"])
    text = ""
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:])
            text += "".join(c.get("text", "") for c in chunk.get("choices", []))
    return text


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_completions_through_the_proxy_equal_one_server(pair: Pair, reference: LLM, stream: bool) -> None:
    before = pair.disk_hits()
    for i in range(len(PROMPTS)):
        r = httpx.post(pair.proxy.url + "/v1/completions", json=_body(i, stream), timeout=60)
        assert r.status_code == 200, r.text
        assert _text(r, stream) == _want(reference, i)
    if not stream:  # the first pass: every full prompt block came from the prefill server
        assert pair.disk_hits() - before == sum((len(p) - 1) // 8 for p in PROMPTS)
    assert pair.proxy.stats.fallbacks == 0 and pair.proxy.stats.prefilled >= len(PROMPTS)


def test_a_chat_through_the_proxy_equals_the_decode_servers_own(pair: Pair) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "the paged KV cache " * 6}],
            "max_tokens": 5, "temperature": 0.0}
    before = pair.disk_hits()
    proxied = httpx.post(pair.proxy.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60)
    assert proxied.status_code == 200
    assert pair.disk_hits() > before
    local = httpx.post(pair.decode.url + "/v1/chat/completions",
                       json={**body, "kv_transfer_params": {"load_remote": False}}, timeout=60)
    content = ""
    for line in proxied.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            content += "".join(c["delta"].get("content", "") for c in json.loads(line[6:])["choices"])
    assert content == local.json()["choices"][0]["message"]["content"]


def test_the_tiers_show_on_metrics(pair: Pair) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    def samples(url: str) -> dict[tuple[str, str], float]:
        out: dict[tuple[str, str], float] = {}
        for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
            for s in family.samples:
                out[(s.name, s.labels.get("medium", s.labels.get("kind", "")))] = s.value
        return out

    httpx.post(pair.proxy.url + "/v1/completions", json=_body(0, False), timeout=60)
    pre, dec = samples(pair.prefill.url), samples(pair.decode.url)
    assert pre[("deepinfer_kv_tier_saved_total", "disk")] > 0 and pre[("deepinfer_kv_answers_held", "")] == 0
    assert dec[("deepinfer_kv_tier_hits_total", "disk")] == pair.disk_hits() > 0
    assert dec[("deepinfer_kv_tier_loaded_tokens_total", "")] > 0
    assert ("deepinfer_kv_tier_failures_total", "late_read") in dec


def test_the_prefill_server_answers_once_the_prompt_is_on_disk(pair: Pair) -> None:
    fresh = [(11 * j) % 250 + 2 for j in range(8 * 6 + 3)]  # six full blocks nobody wrote yet
    files = set(pair.folder.glob("*.kvb"))
    r = httpx.post(pair.prefill.url + "/v1/completions",
                   json={"model": "tiny", "prompt": fresh, "max_tokens": 9}, timeout=60)
    assert r.status_code == 200
    assert len(r.json()["choices"][0]["text"]) > 0 and r.json()["usage"]["completion_tokens"] == 1
    new = set(pair.folder.glob("*.kvb")) - files  # read at once: no waiting for writes
    assert len(new) == 6
    assert r.json()["kv_transfer_params"] == {"remote_blocks": 6}  # what the proxy tells the decode server


def test_a_dead_prefill_server_costs_only_the_prefill(pair: Pair, reference: LLM) -> None:
    proxy = Proxy([f"http://127.0.0.1:{free_port()}"], [pair.decode.url])
    try:
        for i in (0, 1):
            r = httpx.post(proxy.url + "/v1/completions", json=_body(i, False), timeout=60)
            assert r.status_code == 200 and _text(r, False) == _want(reference, i)
        assert proxy.stats.fallbacks == 2 and proxy.stats.prefilled == 0
    finally:
        proxy.stop()


def test_a_clients_error_is_the_prefill_servers_answer(pair: Pair) -> None:
    r = httpx.post(pair.proxy.url + "/v1/completions", json={"model": "tiny", "prompt": [1, 2], "top_p": 7.0},
                   timeout=60)
    assert r.status_code == 400 and "top_p" in r.text


def test_bad_kv_transfer_params_name_the_field(pair: Pair) -> None:
    r = httpx.post(pair.decode.url + "/v1/completions",
                   json={"model": "tiny", "prompt": [1, 2, 3], "kv_transfer_params": {"bogus": 1}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    r = httpx.post(pair.decode.url + "/v1/completions",
                   json={"model": "tiny", "prompt": [1, 2, 3], "kv_transfer_params": "yes"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"


def test_roles_the_engine_cannot_play_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="kv_role='prefill' needs kv_tiers with disk_blocks"):
        AsyncLLM("tiny", kv_role="prefill", **POOL)
    with pytest.raises(ConfigError, match="kv_role must be one of"):
        AsyncLLM("tiny", kv_role="middle", kv_tiers={"host_blocks": 8, "disk_blocks": 8,
                                                     "disk_path": str(tmp_path)}, **POOL)
    with pytest.raises(ConfigError, match="at least one prefill server"):
        build_proxy_app([], ["http://127.0.0.1:1"])
    with pytest.raises(ConfigError, match="must start with http"):
        build_proxy_app(["127.0.0.1:1"], ["http://127.0.0.1:1"])


def test_prefill_role_requests_save_and_stop_after_one_token(tmp_path: Path) -> None:
    llm = AsyncLLM("tiny", kv_role="prefill",
                   kv_tiers={"host_blocks": 16, "disk_blocks": 64, "disk_path": str(tmp_path)}, **POOL)

    async def one() -> Any:
        async for out in llm.generate(PROMPTS[2], SamplingParams(max_tokens=30, n=3, logprobs=2)):
            last = out
        return last

    try:
        out = asyncio.run(one())
        assert len(out.outputs) == 1 and len(out.outputs[0].token_ids) == 1
        assert len(list(tmp_path.glob("*.kvb"))) == len(PROMPTS[2]) // 8  # its full blocks, once answered
        asyncio.run(asyncio.wait_for(llm.wait_idle(), 30))
    finally:
        llm.shutdown()


def test_the_decode_server_is_told_what_the_prefill_server_wrote() -> None:
    from deepinfer_kit.serve.pd_proxy import _decode_kv

    said = httpx.Response(200, json={"choices": [], "kv_transfer_params": {"remote_blocks": 3}})
    assert _decode_kv(said) == {"load_remote": True, "remote_blocks": 3}
    assert _decode_kv(httpx.Response(200, json={"choices": []})) == {"load_remote": True}
    assert _decode_kv(httpx.Response(200, json={"kv_transfer_params": {"remote_blocks": True}})) == {"load_remote": True}
    assert _decode_kv(httpx.Response(200, content=b"not json")) == {"load_remote": True}
    assert _decode_kv(None) == {"load_remote": False}
    linked = httpx.Response(200, json={"kv_transfer_params": {"remote_blocks": 2, "remote_link": "0f" * 8}})
    assert _decode_kv(linked) == {"load_remote": True, "remote_blocks": 2, "remote_link": "0f" * 8}
    odd = httpx.Response(200, json={"kv_transfer_params": {"remote_blocks": 2, "remote_link": "not hex"}})
    assert _decode_kv(odd) == {"load_remote": True, "remote_blocks": 2}


def _command(*args: str) -> Any:
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    return subprocess.Popen([sys.executable, "-m", "deepinfer_kit.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _up(proc: Any, url: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{url} did not come up"
        time.sleep(0.1)


def test_the_commands_serve_a_prefill_decode_pair(tmp_path: Path, reference: LLM) -> None:
    tiers = json.dumps({"host_blocks": 32, "disk_blocks": 256, "disk_path": str(tmp_path),
                        "hash_key": secrets.token_hex(32)})
    pool = ["--model", "tiny", "--num-blocks", "256", "--block-size", "8", "--max-model-len", "256",
            "--max-num-seqs", "16", "--kv-tiers", tiers]
    ports = [free_port() for _ in range(3)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs = [_command("serve", "--port", str(ports[0]), "--kv-role", "prefill", *pool),
             _command("serve", "--port", str(ports[1]), "--kv-role", "decode", *pool),
             _command("pd-proxy", "--port", str(ports[2]), "--prefill", urls[0], "--decode", urls[1])]
    try:
        for proc, url in zip(procs, urls):
            _up(proc, url)
        r = httpx.post(urls[2] + "/v1/completions", json=_body(4, False), timeout=60)
        assert r.status_code == 200 and _text(r, False) == _want(reference, 4)
        assert len(list(tmp_path.glob("*.kvb"))) == len(PROMPTS[4]) // 8  # the prefill server wrote them
        stats = httpx.get(urls[2] + "/proxy/stats").json()
        assert stats["prefilled"] == 1 and stats["fallbacks"] == 0
        # --kv-role prefill, asked directly: one token, the prompt saved
        direct = httpx.post(urls[0] + "/v1/completions", json={"model": "tiny", "prompt": PROMPTS[3], "max_tokens": 9},
                            timeout=60).json()
        assert direct["usage"]["completion_tokens"] == 1 and direct["kv_transfer_params"]["remote_blocks"] > 0
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(20)


@pytest.mark.slow  # five processes start: the commands test above covers the default tier
def test_the_serving_benchmark_runs_and_the_pair_gives_one_servers_tokens() -> None:
    import subprocess
    import sys

    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_pd_serve.py"
    out = subprocess.run([sys.executable, str(bench), "--requests", "2", "--warmup", "1", "--concurrency", "1",
                          "--prompt-tokens", "64", "--max-tokens", "4"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    rows = [line for line in out.splitlines() if line.startswith(("one server", "prefill+decode"))]
    assert len(rows) == 2 and all(row.endswith("True") for row in rows), out


def test_a_router_reads_the_servers_kv_events(tmp_path: Path) -> None:
    from deepinfer_kit.cache.tiers.router_view import PrefixRouterView

    key = secrets.token_hex(32)
    servers = [App(ServeOptions(), kv_tiers={"host_blocks": 16, "disk_blocks": 64, "disk_path": str(tmp_path / n),
                                             "hash_key": key}, **POOL) for n in ("a", "b")]
    plain = App(ServeOptions(), **POOL)
    try:
        view = PrefixRouterView(bytes.fromhex(key), 8)
        cursors = [0, 0]
        prompt = PROMPTS[4]
        r = httpx.post(servers[1].url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200
        for i, s in enumerate(servers):
            feed = httpx.get(s.url + "/v1/kv_events", params={"after": cursors[i]}).json()
            assert feed["block_size"] == 8 and not feed["lost"]
            cursors[i] = view.apply_feed(i, feed)
        assert view.best(prompt) == (1, (len(prompt) - 1) // 8)  # the server that computed it
        again = httpx.get(servers[1].url + "/v1/kv_events", params={"after": cursors[1]}).json()
        assert again["events"] == [] and again["last"] == cursors[1]  # a cursor reads each event once
        first = httpx.get(servers[1].url + "/v1/kv_events").json()  # another router, from the start
        assert first["events"] and first["last"] == cursors[1]
        for bad in ("abc", "-5", "1e3", "9" * 40):
            r = httpx.get(servers[0].url + "/v1/kv_events", params={"after": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "after", bad
        missing = httpx.get(plain.url + "/v1/kv_events")
        assert missing.status_code == 404 and "no kv_tiers" in missing.text
    finally:
        for s in (*servers, plain):
            s.stop()


def test_a_feed_says_when_a_reader_lost_events() -> None:
    from deepinfer_kit.cache.tiers.records import KVEvent
    from deepinfer_kit.serve.kv_events import KVEventFeed

    feed = KVEventFeed(limit=2)
    feed.extend([KVEvent("stored", "device", (b"a",)), KVEvent("stored", "host", (b"a",))])
    assert feed.since(0)["lost"] is False and len(feed.since(0)["events"]) == 2
    feed.extend([KVEvent("removed", "device", (b"a",))])
    late = feed.since(0)  # event 1 fell out before this reader saw it
    assert late["lost"] is True and [e["seq"] for e in late["events"]] == [2, 3] and late["last"] == 3
    assert feed.since(1)["lost"] is False  # it saw event 1: nothing it missed was dropped


def test_the_proxy_reads_a_body_as_a_server_does(pair: Pair) -> None:
    url = pair.proxy.url + "/v1/completions"
    bad = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "body"
    text = httpx.post(url, content=b"{}", headers={"content-type": "text/plain"})
    assert text.status_code == 415
    big = httpx.post(url, content=b"[" + b"1," * (5 * 2**20) + b"1]", headers={"content-type": "application/json"})
    assert big.status_code == 413
    deep = httpx.post(url, content=b"[" * 10_000 + b"]" * 10_000, headers={"content-type": "application/json"})
    assert deep.status_code == 400
    listed = httpx.post(url, json=[1, 2])  # JSON, not an object: the decode server answers for it
    assert listed.status_code == 400 and listed.json()["error"]["param"] == "body"


def test_a_dead_decode_server_is_a_503() -> None:
    proxy = Proxy([f"http://127.0.0.1:{free_port()}"], [f"http://127.0.0.1:{free_port()}"])
    try:
        r = httpx.post(proxy.url + "/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3]}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailable"
        assert httpx.get(proxy.url + "/v1/models").status_code == 503
        health = httpx.get(proxy.url + "/health")
        assert health.status_code == 503 and len(health.json()["down"]) == 2
    finally:
        proxy.stop()
