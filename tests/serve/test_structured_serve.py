"""Structured outputs over HTTP: ``structured_outputs`` on completions (plain and streamed)
and ``response_format`` (``json_object``, ``json_schema``) on chat give answers that match
their regex / validate against their schema; the same body twice gives the same answer."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
httpx = pytest.importorskip("httpx")

from deepinfer_kit.serve.options import ServeOptions  # noqa: E402
from served_app import App  # noqa: E402

REGEX = r"(yes|no), [0-9]{2}"
SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cache", "sampler"]}, "ok": {"type": "boolean"}},
          "required": ["kind", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def app() -> Iterator[App]:
    a = App(ServeOptions())
    yield a
    a.stop()


def _post(app: App, path: str, body: dict[str, Any]) -> Any:
    r = httpx.post(app.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text[:500]
    return r.json()


def test_completions_follow_a_regex(app: App) -> None:
    body = {"prompt": "Answer:", "max_tokens": 40, "temperature": 1.0, "seed": 5, "n": 3,
            "structured_outputs": {"regex": REGEX}}
    out = _post(app, "/v1/completions", body)
    for choice in out["choices"]:
        assert choice["finish_reason"] == "stop" and re.fullmatch(REGEX, choice["text"]), choice
    assert _post(app, "/v1/completions", body)["choices"] == out["choices"]  # seeded


def test_a_streamed_answer_follows_its_choice(app: App) -> None:
    body = {"prompt": "Pick:", "max_tokens": 20, "temperature": 1.0, "seed": 2, "stream": True,
            "structured_outputs": {"choice": ["paged attention", "prefix cache"]}}
    text = ""
    with httpx.stream("POST", app.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    assert text in ("paged attention", "prefix cache")


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
    {"type": "json_object"},
], ids=["json_schema", "json_object"])
def test_chat_response_format(app: App, fmt: dict[str, Any]) -> None:
    body = {"messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 60, "temperature": 0.7,
            "seed": 1, "response_format": fmt}
    choice = _post(app, "/v1/chat/completions", body)["choices"][0]
    text = choice["message"]["content"]
    if choice["finish_reason"] == "stop":
        value = json.loads(text)
        assert isinstance(value, dict)
        if fmt["type"] == "json_schema":
            jsonschema.validate(value, SCHEMA)
    else:  # cut by max_tokens: reported as length, never as a finished answer
        assert choice["finish_reason"] == "length" and text.startswith("{")


def test_asyncllm_compiles_a_grammar_off_the_engine_thread() -> None:
    """While a spec compiles (held here), the engine serves an unconstrained request; a spec
    that does not compile raises from the constrained request's first iteration only."""
    import asyncio
    import threading

    from deepinfer_kit import SamplingParams
    from deepinfer_kit.sample.structured import StructuredOutputError
    from deepinfer_kit.sample.structured.check import GrammarCheck
    from deepinfer_kit.serve import AsyncLLM

    llm = AsyncLLM("tiny-words")
    builder = llm.engine._builder  # the test holds the engine's compile check
    real = builder.grammar
    release = threading.Event()

    class Held:
        vocab_size = real._vocab_size

        def compile(self, spec: Any) -> Any:
            release.wait(30)
            return real._backend.compile(spec) if real._backend is not None else spec

        def matcher(self, grammar: Any, *, max_rollback: int) -> Any:
            raise NotImplementedError

    builder.grammar = GrammarCheck(None, real._vocab_size, [0], backend=Held())  # type: ignore[arg-type]

    async def last(gen: Any) -> Any:
        out = None
        async for out in gen:
            pass
        return out

    async def scenario() -> None:
        constrained = asyncio.create_task(last(llm.generate(
            "Pick:", SamplingParams(max_tokens=20, temperature=1.0, seed=1,
                                    structured_outputs={"choice": ["yes", "no"]}))))
        plain = await asyncio.wait_for(last(llm.generate("Hello", SamplingParams(max_tokens=4))), 30)
        assert plain.finished and not constrained.done()  # served while the grammar compiles
        release.set()
        out = await asyncio.wait_for(constrained, 30)
        assert out.outputs[0].text in ("yes", "no")
        builder.grammar = real
        with pytest.raises(StructuredOutputError, match="structured_outputs"):
            await last(llm.generate("x", SamplingParams(structured_outputs={"regex": "(unclosed"})))

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        llm.shutdown()
