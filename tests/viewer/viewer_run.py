"""A recorded tiny-engine run with prefix hits, preemption and forks (n > 1), checked
against the live engine at every step; shared by the recorder and the browser tests."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from deepinfer_kit.engine.build import build_engine
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.engine.engine import Engine
from deepinfer_kit.outputs import RequestOutput
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.viewer import TraceRecorder, TraceDoc

SHARED = list(range(1, 14))  # 13 tokens: three full blocks of 4 shared by several prompts


@attrs.define
class Run:
    engine: Engine
    recorder: TraceRecorder
    outputs: dict[str, RequestOutput]
    live: list[dict[str, object]]  # per step, the engine's own state read at the callback

    @property
    def doc(self) -> TraceDoc:
        return self.recorder.document()


def live_state(engine: Engine) -> dict[str, object]:
    """What the engine holds right now, read directly (the oracle for the recorder)."""
    alloc = engine.cache.allocator  # type: ignore[attr-defined]
    return {
        "tables": {r.request_id: list(r.block_table) for r in engine.scheduler.running},  # type: ignore[attr-defined]
        "refs": [alloc.ref_count(b) for b in range(alloc.num_blocks)],
        "num_free": engine.cache.num_free_blocks,
        "waiting": [r.request_id for r in engine.scheduler.waiting],  # type: ignore[attr-defined]
    }


def record_run(*, overlap: bool = False, speculative: dict[str, object] | None = None,
               min_steps: int = 30, mutate: Callable[[TraceRecorder], None] | None = None) -> Run:
    """Four requests sharing a prefix (one forks into 2, one is greedy with logprobs) and
    two late arrivals that hit the prefix cache, on a 16-block pool that forces preemption."""
    live: list[dict[str, object]] = []
    engine = build_engine(EngineConfig(
        model="tiny", num_blocks=16, block_size=4, max_num_batched_tokens=16, max_num_seqs=6,
        max_model_len=64, overlap=overlap, speculative=speculative,
    ), trace=lambda _t: live.append(live_state(engine)))
    recorder = TraceRecorder.attach(engine, model="tiny")
    if mutate is not None:
        mutate(recorder)
    sampled = SamplingParams(max_tokens=12, temperature=0.9, top_k=8, seed=7, logprobs=3)
    engine.add_request("a", SHARED + [20, 21], SamplingParams(max_tokens=14, temperature=0.0, logprobs=3))
    engine.add_request("b", SHARED + [30], attrs.evolve(sampled, n=2))
    engine.add_request("c", [40, 41, 42, 43, 44, 45, 46], SamplingParams(max_tokens=16, top_p=0.9, seed=3))
    engine.add_request("d", SHARED + [50, 51], SamplingParams(max_tokens=10, min_p=0.05, seed=4, logprobs=2))
    outputs: dict[str, RequestOutput] = {}
    greedy = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)
    late = {8: ("e", SHARED + [60], greedy), 16: ("f", SHARED + [70, 71], greedy),
            22: ("g", SHARED + [80], attrs.evolve(sampled, n=2, seed=9))}
    step = 0
    while engine.has_unfinished_requests() or step in late or step < max(late):
        if step in late:
            rid, prompt, params = late[step]
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            outputs[out.request_id] = out
        step += 1
    for out in engine.flush():
        outputs[out.request_id] = out
    engine.check_idle()
    assert len(recorder.traces) >= min_steps, len(recorder.traces)
    return Run(engine, recorder, outputs, live)


def completions(run: Run) -> dict[str, list[int]]:
    """Every sequence's generated tokens, by sequence id (a fork child: ``"{id}#{i}"``)."""
    return {
        (f"{rid}#{c.index}" if c.index else rid): list(c.token_ids)
        for rid, out in run.outputs.items()
        for c in out.outputs
    }


def recorded_tokens(doc: TraceDoc) -> dict[str, list[int]]:
    """The same, rebuilt from the trace's per-step token records (checking their indices)."""
    seqs: dict[str, list[int]] = {}
    for step in doc["steps"]:
        for tok in step["tokens"]:
            seq = seqs.setdefault(tok["request"], [])
            assert tok["index"] == len(seq), tok
            seq.append(tok["token"])
    return seqs


EPLB = {"window": 4, "interval": 5, "num_redundant": 4, "num_gpus": 4}


def record_eplb_run(eplb: dict[str, object] | None = None) -> Run:
    """Four greedy requests on the tiny MoE model with live EPLB (12 slots on 4 GPUs,
    rebalancing every 5 steps): 12 steps, rebalances before steps 5 and 10."""
    engine = build_engine(EngineConfig(
        model="tiny", num_blocks=32, block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
        max_model_len=64, eplb=eplb or EPLB,
    ))
    recorder = TraceRecorder.attach(engine, model="tiny")
    for i in range(4):
        engine.add_request(str(i), list(range(1 + i, 12 + i)), SamplingParams(max_tokens=10, temperature=0.0))
    outputs = {out.request_id: out for out in engine.run()}
    engine.check_idle()
    return Run(engine, recorder, outputs, [])
