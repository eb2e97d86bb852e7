"""The OpenAI-compatible server on 127.0.0.1: the official client, raw HTTP, disconnects, load."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deepinfer_kit import LLM, SamplingParams

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from deepinfer_kit.serve import AsyncLLM  # noqa: E402
from deepinfer_kit.serve.api import build_app  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from test_chat import CHATML  # noqa: E402

ENGINE = dict(num_blocks=512, block_size=8, max_model_len=256, max_num_seqs=128)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """An AsyncLLM behind uvicorn in a thread, and the calls its tests make."""

    def __init__(self) -> None:
        self.llm = AsyncLLM("tiny", **ENGINE)
        self.aborted: list[str] = []
        engine_abort = self.llm.engine.abort

        def recording_abort(request_id: str) -> bool:
            self.aborted.append(request_id)
            return engine_abort(request_id)

        self.llm.engine.abort = recording_abort  # type: ignore[method-assign]
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = build_app(self.llm, model_name="tiny", chat_template=CHATML)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def wait_idle(self) -> None:
        asyncio.run(asyncio.wait_for(self.llm.wait_idle(), 15))

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.llm.shutdown()


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(served: Served) -> Any:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM("tiny", **ENGINE)


def test_completions_match_the_batch_api(client: Any, reference: LLM, served: Served) -> None:
    got = client.completions.create(model="tiny", prompt=["Hello", "Paged attention"], max_tokens=6,
                                    n=2, logprobs=2, extra_body={"top_k": 1})
    want = reference.generate(["Hello", "Paged attention"], SamplingParams(max_tokens=6, top_k=1, n=2, logprobs=2))
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    for choice in got.choices:
        ref = want[choice.index // 2].outputs[choice.index % 2]
        assert choice.text == ref.text and choice.finish_reason == ref.finish_reason
        assert choice.logprobs.token_logprobs == pytest.approx([lp[t].logprob for t, lp in zip(ref.token_ids, ref.logprobs)])
        assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert got.usage.completion_tokens == 24
    assert got.usage.prompt_tokens == len("Hello") + len("Paged attention")  # once per prompt, whatever n
    served.wait_idle()


def test_chat_matches_llm_chat(client: Any, reference: LLM) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0, seed=3)
    want = reference.chat(messages, SamplingParams(max_tokens=5, temperature=0, seed=3), chat_template=CHATML)[0]
    assert got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)


def test_streams_concatenate_to_the_full_answer(client: Any, served: Served) -> None:
    full = client.completions.create(model="tiny", prompt="Stream me", max_tokens=7, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt="Stream me", max_tokens=7, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 7
    messages = [{"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    parts = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert all(p.object == "chat.completion.chunk" for p in parts)
    assert "".join(p.choices[0].delta.content or "" for p in parts) == whole.choices[0].message.content
    assert parts[-1].choices[0].finish_reason == "length"
    served.wait_idle()


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_the_usage_chunk_of_a_stream_equals_the_unstreamed_usage(client: Any, served: Served, kind: str) -> None:
    """Prompt tokens once per prompt (not per chunk, not per choice), completion tokens of
    every choice, their total: the same whether streamed or not, with n > 1 and two
    prompts (completions) streamed over many chunks."""
    common = dict(model="tiny", max_tokens=9, temperature=0.8, seed=5, n=3)
    if kind == "completions":
        call = client.completions.create
        args: dict[str, Any] = dict(prompt=["Usage counts", "Paged attention again"], **common)
    else:
        call = client.chat.completions.create
        args = dict(messages=[{"role": "user", "content": "Count my tokens"}], **common)
    whole = call(**args).usage
    chunks = list(call(**args, stream=True, stream_options={"include_usage": True}))
    streamed = chunks[-1].usage
    assert len([c for c in chunks if c.choices]) > 3  # many chunks: a per-chunk count would show
    assert (streamed.prompt_tokens, streamed.completion_tokens, streamed.total_tokens) == (
        whole.prompt_tokens, whole.completion_tokens, whole.total_tokens)
    assert whole.total_tokens == whole.prompt_tokens + whole.completion_tokens
    served.wait_idle()


def test_raw_sse_ends_with_done_and_models_and_health(served: Served) -> None:
    with httpx.Client(base_url=served.url, timeout=10) as http:
        assert http.get("/health").status_code == 200
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny"]
        r = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "stream": True})
        events = [line for line in r.text.split("\n\n") if line]
        assert r.headers["content-type"].startswith("text/event-stream")
        assert events[-1] == "data: [DONE]"
        assert all(json.loads(e[len("data: "):])["object"] == "text_completion" for e in events[:-1])


@pytest.mark.parametrize(("body", "param", "words"), [
    (b"{not json", None, "not valid JSON"),
    (b"[1, 2]", None, "JSON object"),
    (json.dumps({"prompt": "x", "temperature": "hot"}).encode(), "temperature", "temperature"),
    (json.dumps({"prompt": "x", "top_p": 0.0}).encode(), "top_p", "top_p"),
    (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), "max_tokens", "max_tokens"),
    (json.dumps({"prompt": 5}).encode(), "prompt", "prompt"),
    (json.dumps({"prompt": "x", "logit_bias": {"one": 5}}).encode(), "logit_bias", "logit_bias"),
    (json.dumps({"prompt": "x" * 300, "stream": True}).encode(), None, "max_model_len"),
    (json.dumps({"prompt": [1, 2, 999999]}).encode(), None, "259"),
])
def test_bad_requests_get_400_naming_the_field(served: Served, body: bytes, param: str | None, words: str) -> None:
    r = httpx.post(served.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["code"] == 400
    if param is not None:
        assert error["param"] == param


def test_openai_client_sees_bad_requests_and_unknown_models(client: Any) -> None:
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny", messages=[])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-9", prompt="x")


def test_a_client_that_disconnects_mid_stream_aborts_its_request(served: Served) -> None:
    before = len(served.aborted)
    with httpx.Client(base_url=served.url, timeout=10) as http:
        with http.stream("POST", "/v1/completions", json={
            "prompt": "go on " * 4, "max_tokens": 200, "ignore_eos": True, "stream": True,
        }) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(3)]
            assert all(line.startswith("data: ") or not line for line in got)
    deadline = time.monotonic() + 10
    while len(served.aborted) == before:
        assert time.monotonic() < deadline, "the disconnected stream's request was never aborted"
        time.sleep(0.01)
    served.wait_idle()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_client_that_leaves_before_a_plain_answer_aborts_its_request(served: Served, path: str) -> None:
    engine = served.llm.engine
    step = engine.step

    def slow_step() -> Any:  # the answer takes seconds; the client waits a fraction of one
        time.sleep(0.01)
        return step()

    body: dict[str, Any] = {"max_tokens": 150, "ignore_eos": True}
    body.update({"prompt": "wait for it"} if "chat" not in path else
                {"messages": [{"role": "user", "content": "wait for it"}]})
    before = len(served.aborted)
    engine.step = slow_step  # type: ignore[method-assign]
    try:
        with httpx.Client(base_url=served.url, timeout=httpx.Timeout(10, read=0.3)) as http:
            with pytest.raises(httpx.ReadTimeout):
                http.post(path, json=body)
        deadline = time.monotonic() + 10
        while len(served.aborted) == before:
            assert time.monotonic() < deadline, "the departed client's request was never aborted"
            time.sleep(0.01)
    finally:
        engine.step = step  # type: ignore[method-assign]
    served.wait_idle()


def test_hundred_concurrent_streams_finish_and_leak_nothing(served: Served) -> None:
    async def one(http: Any, i: int) -> tuple[str, int]:
        text, done = "", 0
        async with http.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": f"client {i}"}], "max_tokens": 4,
            "ignore_eos": True, "temperature": 0.7, "seed": i, "stream": True,
        }) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done += 1
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    text += chunk["choices"][0]["delta"].get("content") or ""
        return text, done

    async def main() -> list[tuple[str, int]]:
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=served.url, timeout=60, limits=limits) as http:
            return list(await asyncio.gather(*(one(http, i) for i in range(100))))

    results = asyncio.run(main())
    assert [done for _, done in results] == [1] * 100
    assert sum(1 for text, _ in results if text) >= 90  # byte tokens may hold back a split char
    served.wait_idle()


def test_the_serve_command_starts_a_server(tmp_path: Path) -> None:
    import os
    import subprocess

    template = tmp_path / "chat.jinja"
    template.write_text(CHATML)
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "deepinfer_kit.cli", "serve", "--port", str(port), "--num-blocks", "64",
         "--max-model-len", "128", "--block-size", "8", "--chat-template", str(template),
         "--served-model-name", "tiny-served", "--gpu-memory-utilization", "0.5"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "deepinfer-kit serve did not come up"
            time.sleep(0.1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny-served"]
        chat = client.chat.completions.create(model="tiny-served", max_tokens=3,
                                              messages=[{"role": "user", "content": "hi"}])
        assert chat.choices[0].finish_reason in ("length", "stop")
    finally:
        proc.terminate()
        proc.wait(20)
