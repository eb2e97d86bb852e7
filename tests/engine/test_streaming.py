"""Streaming: Engine.step() reports every CUMULATIVE / DELTA request that produced tokens in
the round it commits, and the reports add up to the final output (synchronous and
overlapped, with stop strings, n > 1 and logprobs)."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from deepinfer_kit import RequestOutputKind, SamplingParams, build_engine
from deepinfer_kit.engine.trace import StepTrace
from deepinfer_kit.outputs import CompletionOutput, RequestOutput

PROMPTS = ["Hello there", "abcabcabc", "é€ü", "one more prompt", "0101"]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=["zq", "\x05!"]),
    SamplingParams(temperature=0.9, seed=5, n=3, max_tokens=12, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=16, stop="e", include_stop_str_in_output=True),
    SamplingParams(temperature=0.7, seed=1, max_tokens=9, stop=["ab", "c"]),
    SamplingParams(temperature=0.0, max_tokens=1),
]


def _final(overlap: bool) -> dict[str, RequestOutput]:
    engine = build_engine(overlap=overlap)
    for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS)):
        engine.add_request(f"r{i}", p, sp)
    outs = {o.request_id: o for o in engine.run()}
    engine.check_idle()
    return outs


def _stream(kind: RequestOutputKind, overlap: bool) -> tuple[list[list[RequestOutput]], list[list[StepTrace]]]:
    traces: list[StepTrace] = []
    engine = build_engine(overlap=overlap, trace=traces.append)
    for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS)):
        engine.add_request(f"r{i}", p, attrs.evolve(sp, output_kind=kind))
    rounds, round_traces = [], []
    while engine.has_unfinished_requests():
        rounds.append(engine.step())
        round_traces.append(traces[:])
        traces.clear()
    rounds.append(engine.flush())
    round_traces.append(traces[:])
    engine.check_idle()
    return rounds, round_traces


def _fields(c: CompletionOutput) -> tuple[Any, ...]:
    lps = None if c.logprobs is None else [{k: (v.logprob, v.decoded_token) for k, v in d.items()}
                                          for d in c.logprobs]
    return (c.text, c.token_ids, lps, c.finish_reason, c.stop_reason)


@pytest.mark.parametrize("overlap", [False, True])
def test_deltas_add_up_to_the_final_output(overlap: bool) -> None:
    final = _final(overlap)
    rounds, _ = _stream(RequestOutputKind.DELTA, overlap)
    joined: dict[tuple[str, int], CompletionOutput] = {}
    finished: dict[str, int] = {}
    for outs in rounds:
        assert len({o.request_id for o in outs}) == len(outs)  # one output per request per round
        for o in outs:
            assert o.request_id not in finished  # nothing after the finished output
            if o.finished:
                finished[o.request_id] = 1
            for c in o.outputs:
                assert c.token_ids or c.finish_reason  # a delta carries news
                key = (o.request_id, c.index)
                acc = joined.setdefault(key, CompletionOutput(c.index, "", [], logprobs=[] if c.logprobs is not None else None))
                assert acc.finish_reason is None
                acc.text += c.text
                acc.token_ids += c.token_ids
                if c.logprobs is not None and acc.logprobs is not None:
                    acc.logprobs += c.logprobs
                acc.finish_reason, acc.stop_reason = c.finish_reason, c.stop_reason
    assert sorted(finished) == sorted(final)
    assert final["r0"].outputs[0].stop_reason == "\x05!"  # the stop paths are exercised
    for rid, out in final.items():
        for c in out.outputs:
            assert _fields(joined[(rid, c.index)]) == _fields(c), (rid, c.index)


@pytest.mark.parametrize("overlap", [False, True])
def test_cumulative_outputs_grow_to_the_final_output(overlap: bool) -> None:
    final = _final(overlap)
    rounds, round_traces = _stream(RequestOutputKind.CUMULATIVE, overlap)
    last: dict[str, RequestOutput] = {}
    done: set[str] = set()
    for outs, traces in zip(rounds, round_traces):
        produced = {c.request_id.split("#")[0] for t in traces for c in t.chunks if c.sampled}
        assert {o.request_id for o in outs} == produced - done  # every request with tokens
        for o in outs:
            before = last.get(o.request_id)
            for c in o.outputs:
                prev = next((p for p in before.outputs if p.index == c.index), None) if before else None
                if prev is not None:
                    assert c.text.startswith(prev.text) and c.token_ids[: len(prev.token_ids)] == prev.token_ids
            last[o.request_id] = o
            if o.finished:
                done.add(o.request_id)
    assert done == set(final)
    for rid, out in final.items():
        assert last[rid].finished
        assert [_fields(c) for c in last[rid].outputs] == [_fields(c) for c in out.outputs]


def test_stop_text_is_held_back_until_it_cannot_be_a_stop() -> None:
    engine = build_engine()
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop="never-seen",
                        output_kind=RequestOutputKind.CUMULATIVE)
    engine.add_request("a", "Hello there", sp)
    texts, tokens = [], []
    while engine.has_unfinished_requests():
        for o in engine.step():
            texts.append(o.outputs[0].text)
            tokens.append(len(o.outputs[0].token_ids))
    assert all(t == "" for t in texts[:-1])  # under 10 chars: all could start the stop
    assert texts[-1] and tokens == list(range(1, 13))
    engine.check_idle()


def test_final_only_reports_once() -> None:
    engine = build_engine()
    engine.add_request("a", "hi", SamplingParams(max_tokens=5))
    rounds = []
    while engine.has_unfinished_requests():
        rounds.append(engine.step())
    assert [len(r) for r in rounds].count(1) == 1 and rounds[-1][0].finished
