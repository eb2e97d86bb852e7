"""The overlapped engine (depth 1: round k+1 scheduled while round k runs, state committed
one step late) gives the synchronous engine's outputs token for token."""

from __future__ import annotations

import random
from typing import Any

import pytest

from deepinfer_kit import SamplingParams, build_engine
from differential import run_workload as _run, workload as _workload

SMALL_POOL = {"num_blocks": 20, "block_size": 8, "max_model_len": 96, "max_num_seqs": 8,
              "max_num_batched_tokens": 64, "long_prefill_token_threshold": 24}
ROOMY = {"num_blocks": 200, "block_size": 8, "max_model_len": 96, "max_num_seqs": 16,
         "max_num_batched_tokens": 96}


@pytest.mark.parametrize("config", [ROOMY, SMALL_POOL], ids=["roomy", "preempting"])
@pytest.mark.parametrize("seed", [0, 1])
def test_overlap_equals_sync_token_for_token(seed: int, config: dict[str, Any]) -> None:
    reqs = _workload(seed, 30)
    want, sync_engine = _run(reqs, False, **config)
    got, engine = _run(reqs, True, **config)
    assert engine.executor.depth == 1 and sync_engine.executor.depth == 0
    assert got == want
    reasons = {c[1] for outs in want.values() for c in outs}
    assert {"stop", "length"} <= reasons, reasons


def test_preemption_really_happens_in_the_small_pool() -> None:
    traces: list[Any] = []
    engine = build_engine(overlap=True, **SMALL_POOL, trace=traces.append)
    for rid, prompt, params in _workload(0, 30):
        engine.add_request(rid, prompt, params)
    engine.run()
    engine.check_idle()
    assert any(t.preempted for t in traces) and sum(t.prefix_hit_tokens for t in traces) > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_aborts_at_every_step_leave_nothing_behind(seed: int) -> None:
    reqs = _workload(seed, 24)
    want, _ = _run(reqs, False, **SMALL_POOL)
    rng = random.Random(seed)
    aborts: dict[int, list[str]] = {}
    for rid, _, _ in reqs:
        if rng.random() < 0.4:
            aborts.setdefault(rng.randrange(0, 30), []).append(rid)
    got, _ = _run(reqs, True, aborts=aborts, **SMALL_POOL)
    assert set(got) == set(want)
    aborted = {rid for ids in aborts.values() for rid in ids}
    for rid, comps in got.items():
        for (toks, reason, _), (want_toks, want_reason, _) in zip(comps, want[rid]):
            if reason == "abort":
                assert rid in aborted
                assert want_toks[: len(toks)] == toks or want_reason != "length"
            else:
                assert (toks, reason) == (want_toks, want_reason), rid


def test_a_stop_in_flight_discards_the_token_already_scheduled() -> None:
    # Every sampled token is a stop token: the request stops at its first token, while
    # the overlapped engine has already scheduled its second.
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=10, stop_token_ids=list(range(259)))
    traces: list[Any] = []
    engine = build_engine(overlap=True, num_blocks=32, block_size=8, max_model_len=64, trace=traces.append)
    engine.add_request("s", [1, 2, 3], params)
    engine.add_request("other", [4, 5, 6], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    outs = {o.request_id: o for o in engine.run()}
    assert len(outs["s"].outputs[0].token_ids) == 1 and outs["s"].outputs[0].finish_reason == "stop"
    assert len(outs["other"].outputs[0].token_ids) == 5
    scheduled_after_stop = [c for t in traces[1:] for c in t.chunks if c.request_id == "s"]
    assert scheduled_after_stop, "the overlapped engine scheduled a token past the stop"
    engine.check_idle()


def test_overlap_under_the_fault_injector_loses_nothing() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
    from faults import FaultInjector

    engine = build_engine(overlap=True, **SMALL_POOL)
    injector = FaultInjector(engine, 3, p_forward=0.05, p_sampler=0.05, p_commit=0.05, p_nan=0.05)
    reqs = _workload(3, 40)
    for rid, prompt, params in reqs:
        engine.add_request(rid, prompt, params)
    outs = {o.request_id: o for o in engine.run()}
    assert set(outs) == {rid for rid, _, _ in reqs}
    assert all(c.finish_reason is not None for o in outs.values() for c in o.outputs)
    assert injector.failed_steps
    engine.check_idle()


@pytest.mark.parametrize("overlap", [False, True])
def test_traces_say_when_tokens_were_sampled_and_committed(overlap: bool) -> None:
    traces: list[Any] = []
    engine = build_engine(overlap=overlap, num_blocks=32, block_size=8, max_model_len=64, trace=traces.append)
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.run()
    sampled = [(t.step_id, t.committed_in) for t in traces if any(c.sampled for c in t.chunks)]
    assert len(sampled) == 4
    late = 1 if overlap else 0
    assert all(committed == step + late for step, committed in sampled[:-1]), sampled
    assert "committed in step" in traces[0].describe() if overlap else True


def test_cli_trace_follows_a_request_under_overlap() -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "deepinfer_kit.cli", "trace", "--overlap", "--prompt", "abc",
         "--max-tokens", "3"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    assert "committed in step 1" in done.stdout, done.stdout


def test_overlap_is_on_by_default_on_cuda_except_with_speculation() -> None:
    from deepinfer_kit import ConfigError, EngineConfig

    assert EngineConfig().overlap is None and not EngineConfig().overlapped  # CPU: measured slower
    assert EngineConfig(device="cuda").overlapped and EngineConfig(device="cuda:1").overlapped
    assert not EngineConfig(device="cuda", speculative={"num_draft": 2}).overlapped
    assert not EngineConfig(device="cuda", overlap=False).overlapped
    assert EngineConfig(overlap=True).overlapped
    assert EngineConfig(worker="process").overlapped  # no shared GIL: measured faster
    assert not EngineConfig(worker="process", overlap=False).overlapped
    assert build_engine(num_blocks=16, max_model_len=64).executor.depth == 0
    assert build_engine(num_blocks=16, max_model_len=64, overlap=True).executor.depth == 1
    assert build_engine(num_blocks=16, max_model_len=64, speculative={"num_draft": 2}).executor.depth == 0
    with pytest.raises(ConfigError, match="overlap must be True, False or None, got .yes."):
        EngineConfig(overlap="yes")  # type: ignore[arg-type]
