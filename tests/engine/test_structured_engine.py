"""Structured outputs in the engine (tiny-words, xgrammar): sampled (seeded) outputs that
finish with ``stop`` match their regex / choice / JSON schema; overlap, a worker process
and greedy speculation give the synchronous engine's tokens; forks (n = 2) each match; a
spec that does not compile refuses its request while the others are served; the mask is
applied before logprobs."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from deepinfer_kit import LLM, SamplingParams  # noqa: E402
from deepinfer_kit.sample.structured import StructuredOutputError, StructuredOutputsParams  # noqa: E402

REGEX = r"[a-z]{2,6} (cache|block|token)s? [0-9]{1,3}"
CHOICES = ["paged attention", "prefix cache", "overlap", "expert placement"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cache", "sampler", "router"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "kind", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-words")


def _params(spec: dict[str, Any], count: int, **kw: Any) -> list[SamplingParams]:
    base: dict[str, Any] = {"max_tokens": 48, "temperature": 1.0}
    base.update(kw)
    return [SamplingParams(seed=100 + i, structured_outputs=spec, **base) for i in range(count)]


def _texts(llm: LLM, params: list[SamplingParams], prompt: str = "The engine") -> list[tuple[str, str | None]]:
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def test_regex_outputs_match(llm: LLM) -> None:
    got = _texts(llm, _params({"regex": REGEX}, 8))
    assert all(reason == "stop" for _, reason in got), got
    for text, _ in got:
        assert re.fullmatch(REGEX, text), text


def test_choice_outputs_are_choices(llm: LLM) -> None:
    got = _texts(llm, _params({"choice": CHOICES}, 8))
    assert {reason for _, reason in got} == {"stop"}
    assert all(text in CHOICES for text, _ in got), got
    assert len({text for text, _ in got}) > 1  # sampled, not one forced answer


def test_json_schema_outputs_validate(llm: LLM) -> None:
    spec = {"json": SCHEMA, "disable_any_whitespace": True}
    got = _texts(llm, _params(spec, 8, max_tokens=64))
    finished = [text for text, reason in got if reason == "stop"]
    assert len(finished) >= 6, got
    for text in finished:
        jsonschema.validate(json.loads(text), SCHEMA)
    for text, reason in got:  # cut by max_tokens: reported as length, a prefix of valid JSON
        assert reason in ("stop", "length"), (text, reason)


def test_forks_each_match(llm: LLM) -> None:
    params = SamplingParams(n=3, max_tokens=48, temperature=1.0, seed=7, structured_outputs={"regex": REGEX})
    (out,) = llm.generate(["Forks"], params, use_tqdm=False)
    assert len(out.outputs) == 3
    for child in out.outputs:
        assert child.finish_reason == "stop" and re.fullmatch(REGEX, child.text), child.text


def test_logprobs_are_those_of_the_masked_distribution(llm: LLM) -> None:
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, logprobs=5,
                            structured_outputs={"choice": ["yes", "no"]})
    (out,) = llm.generate(["Answer:"], params, use_tqdm=False)
    first = out.outputs[0].logprobs[0]  # the first position allows 'y' and 'n' only
    finite = [lp.logprob for lp in first.values() if math.isfinite(lp.logprob)]
    assert len(finite) == 2 and math.isclose(sum(math.exp(x) for x in finite), 1.0, rel_tol=1e-5)


def test_a_spec_that_does_not_compile_refuses_only_its_request(llm: LLM) -> None:
    with pytest.raises(StructuredOutputError, match="regex"):
        llm.generate(["x"], SamplingParams(structured_outputs={"regex": "(unclosed"}), use_tqdm=False)
    assert _texts(llm, _params({"choice": CHOICES}, 2))[0][0] in CHOICES  # the engine serves on


def test_params_accept_the_record_or_a_dict() -> None:
    spec = StructuredOutputsParams(regex="a+")
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == spec
    with pytest.raises(StructuredOutputError, match="exactly one"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["b"]})


def _mixed(llm: LLM) -> list[tuple[str, str | None]]:
    params = (_params({"regex": REGEX}, 3) + _params({"choice": CHOICES}, 3)
              + _params({"json": SCHEMA, "disable_any_whitespace": True}, 3)
              + [SamplingParams(max_tokens=12, temperature=1.0, seed=9)])
    return _texts(llm, params)


@pytest.mark.parametrize("overrides", [{"overlap": True}, {"worker": "process"}],
                         ids=["overlap", "worker-process"])
def test_overlap_and_worker_process_give_the_synchronous_tokens(llm: LLM, overrides: dict[str, Any]) -> None:
    other = LLM("tiny-words", **overrides)
    try:
        assert _mixed(other) == _mixed(llm)
    finally:
        getattr(other, "close", lambda: None)()


def test_greedy_speculation_gives_the_plain_tokens(llm: LLM) -> None:
    spec = LLM("tiny-words", speculative={"drafter": "ngram", "num_draft": 3})
    params = [SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=s)
              for s in ({"regex": REGEX}, {"json": SCHEMA, "disable_any_whitespace": True}, {"choice": CHOICES})]
    prompts = ["the cache the cache the cache", "JSON JSON JSON", "overlap overlap"]
    plain = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    drafted = [o.outputs[0].text for o in spec.generate(prompts, params, use_tqdm=False)]
    assert drafted == plain


def test_preemption_by_recompute_keeps_each_grammar(llm: LLM) -> None:
    from deepinfer_kit import build_engine
    from deepinfer_kit.engine.trace import StepTrace

    params = _params({"regex": REGEX}, 16, max_tokens=40)
    want = [text for text, _ in _texts(llm, params, prompt="The engine said")]
    traces: list[StepTrace] = []
    engine = build_engine(model="tiny-words", num_blocks=12, block_size=8, max_model_len=64,
                          trace=traces.append)
    ids = [engine.add_request(None, "The engine said", p) for p in params]
    outs = {o.request_id: o for o in engine.run()}
    engine.check_idle()
    assert any(t.preempted for t in traces), "the small pool should force a preemption"
    assert [outs[i].outputs[0].text for i in ids] == want
