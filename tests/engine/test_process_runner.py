"""The model runner in a worker process (``worker="process"``): the same tokens as the
in-process engine, synchronous and overlapped, with aborts, preemption, forks and faults;
failures and a dead worker reported, nothing left running or leased."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest

from deepinfer_kit import ConfigError, EngineDeadError, InvariantError, SamplingParams, build_engine
from deepinfer_kit.engine.remote.process_group import ProcessGroupRunner
from deepinfer_kit.engine.remote.process_runner import ProcessRunner, WorkerSpec
from deepinfer_kit.engine.protocols import StepRunner
from deepinfer_kit.testing import STEP_RUNNER_SUITE
from deepinfer_kit.testing.runner import reference_runner
from deepinfer_kit.testing.suite import Check
from differential import run_workload, workload
from faults import RunnerFaults, fail_commits, run_to_end
from runner_hooks import Explode, KeepSlots, MarkSteps

SMALL_POOL = {"num_blocks": 20, "block_size": 8, "max_model_len": 96, "max_num_seqs": 8,
              "max_num_batched_tokens": 64, "long_prefill_token_threshold": 24}
ROOMY = {"num_blocks": 200, "block_size": 8, "max_model_len": 96, "max_num_seqs": 16,
         "max_num_batched_tokens": 96}


def _process_runner(config: Any, depth: int) -> StepRunner:
    return ProcessRunner(WorkerSpec(config, depth))


def _expert_parallel_runner(config: Any, depth: int) -> StepRunner:
    ep = attrs.evolve(config, worker="process", expert_parallel=2)
    return ProcessGroupRunner(WorkerSpec(ep, depth))


RUNNERS: dict[str, Callable[[Any, int], StepRunner]] = {
    "inline": reference_runner, "process": _process_runner, "expert-parallel": _expert_parallel_runner,
}


@pytest.mark.parametrize("name", sorted(RUNNERS))
@pytest.mark.parametrize("check", STEP_RUNNER_SUITE, ids=STEP_RUNNER_SUITE.ids)
def test_conformance(check: Check[Callable[[Any, int], StepRunner]], name: str) -> None:
    check(RUNNERS[name])


@pytest.mark.parametrize("config", [ROOMY, SMALL_POOL], ids=["roomy", "preempting"])
def test_the_worker_gives_the_inline_engines_tokens(config: dict[str, Any]) -> None:
    reqs = workload(4, 30)
    want, _ = run_workload(reqs, False, **config)
    for overlap in (False, True):
        got, engine = run_workload(reqs, overlap, worker="process", **config)
        assert type(engine.runner).__name__ == "ProcessRunner" and engine.executor.depth == int(overlap)
        assert got == want, overlap
        engine.close()


def test_aborts_at_random_steps_under_the_overlapped_worker() -> None:
    reqs = workload(5, 24)
    want, _ = run_workload(reqs, False, **SMALL_POOL)
    rng = random.Random(5)
    aborts: dict[int, list[str]] = {}
    for rid, _, _ in reqs:
        if rng.random() < 0.4:
            aborts.setdefault(rng.randrange(0, 30), []).append(rid)
    got, engine = run_workload(reqs, True, aborts=aborts, worker="process", **SMALL_POOL)
    engine.close()
    aborted = {rid for ids in aborts.values() for rid in ids}
    for rid, comps in got.items():
        for (toks, reason, _), (want_toks, want_reason, _) in zip(comps, want[rid]):
            if reason == "abort":
                assert rid in aborted and want_toks[: len(toks)] == toks
            else:
                assert (toks, reason) == (want_toks, want_reason), rid
    assert any(c[1] == "abort" for comps in got.values() for c in comps)


def test_faults_in_the_worker_fail_their_requests_only() -> None:
    engine = build_engine(overlap=True, worker="process", **SMALL_POOL,
                          worker_setup=RunnerFaults(3, p_forward=0.08, p_sampler=0.05, p_nan=0.08))
    fail_commits(engine, 3, 0.05)
    outs, reasons = run_to_end(engine, workload(3, 40))
    assert "error" in reasons and {"stop", "length"} & set(reasons)
    messages = {c.stop_reason for o in outs.values() for c in o.outputs if c.finish_reason == "error"}
    assert any("InjectedFault('forward failed')" in str(m) for m in messages), messages
    assert any("non-finite logits" in str(m) for m in messages), messages
    engine.check_idle()
    engine.close()


def test_a_killed_worker_kills_the_engine_at_once() -> None:
    engine = build_engine(overlap=True, worker="process", **ROOMY)
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.step()
    os.kill(engine.runner.pid, signal.SIGKILL)  # type: ignore[attr-defined]
    with pytest.raises(EngineDeadError, match=r"model worker process \(pid \d+\) exited with code -9"):
        for _ in range(3):  # the round in flight, then the next send
            engine.step()
    with pytest.raises(EngineDeadError):
        engine.add_request("b", [1], SamplingParams(max_tokens=1))
    engine.close()


def test_build_errors_in_the_worker_reach_the_caller() -> None:
    with pytest.raises(ConfigError, match="max_model_len must be <= the model's max_position_embeddings"):
        build_engine(worker="process", max_model_len=10**6, num_blocks=8)
    with pytest.raises(RuntimeError, match="setup exploded"):
        build_engine(worker="process", num_blocks=8, max_model_len=64, worker_setup=Explode())
    with pytest.raises(ConfigError, match="pickle by reference"):
        build_engine(worker="process", num_blocks=8, max_model_len=64, worker_setup=lambda runner: None)


def test_the_worker_field_is_checked() -> None:
    from deepinfer_kit import EngineConfig

    EngineConfig(worker="process", speculative={"drafter": "self", "draft_layers": 1},
                 eplb={"window": 4, "interval": 4})  # both run in the worker
    with pytest.raises(ConfigError, match="worker must be one of"):
        EngineConfig(worker="thread")


def test_the_idle_check_sees_slots_leaked_in_the_worker() -> None:
    engine = build_engine(overlap=True, worker="process", worker_setup=KeepSlots(), **ROOMY)
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3))
    engine.run()
    with pytest.raises(InvariantError, match="token slots still leased"):
        engine.check_idle()
    engine.close()


def test_the_host_schedules_while_the_worker_runs(tmp_path: Path) -> None:
    """Under overlap ``step()`` returns while the worker still runs the round it sent (its
    marker file is written only after a 1 s sleep); synchronously it returns after."""
    for overlap in (True, False):
        folder = tmp_path / str(overlap)
        folder.mkdir()
        engine = build_engine(overlap=overlap, worker="process", worker_setup=MarkSteps(str(folder), 1.0), **ROOMY)
        engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        engine.step()
        ran_before_return = (folder / "done-0").exists()
        engine.run()
        engine.check_idle()
        engine.close()
        assert ran_before_return != overlap, (overlap, ran_before_return)


def test_close_stops_the_worker_and_a_dead_host_stops_it_too() -> None:
    engine = build_engine(worker="process", num_blocks=16, max_model_len=64)
    pid = engine.runner.pid  # type: ignore[attr-defined]
    engine.close()
    engine.close()
    _gone(pid)
    with pytest.raises(EngineDeadError, match="closed"):
        engine.step()
    script = ("from deepinfer_kit import build_engine; import os; "
              "e = build_engine(worker='process', num_blocks=16, max_model_len=64); "
              "print(e.runner.pid, flush=True); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    _gone(int(out.stdout.split()[-1]))


def _gone(pid: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        try:  # reap it if it is our child
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"worker {pid} still running")
