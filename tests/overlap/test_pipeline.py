"""Pipelined executors: a two-phase step k+1 is launched before step k is finished when the
caller launched it before waiting for k (and k+1 allows it); results, exceptions and
finishes stay per step, in launch order. Orders are recorded by the fake steps and fixed
by the order of the caller's calls, never by timing."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from deepinfer_kit.overlap import OverlapExecutor, ThreadExecutor, TwoPhaseRun
from deepinfer_kit.step import StepResult
from deepinfer_kit.testing import OVERLAP_EXECUTOR_SUITE
from deepinfer_kit.testing.overlap import two_phase_step
from deepinfer_kit.testing.suite import Check


@pytest.mark.parametrize("check", OVERLAP_EXECUTOR_SUITE, ids=OVERLAP_EXECUTOR_SUITE.ids)
def test_a_pipelining_thread_executor_conforms(check: Check[Callable[[], OverlapExecutor]]) -> None:
    check(lambda: ThreadExecutor(pipeline=True))


def _drive(executor: OverlapExecutor, runs: list[Callable[[], StepResult]]) -> list[Any]:
    """Launch every run, then wait for each in order; results (or exception texts)."""
    pending = [executor.launch(i, run) for i, run in enumerate(runs)]
    out: list[Any] = []
    for p in pending:
        try:
            out.append(executor.wait(p).token_ids)
        except RuntimeError as exc:
            out.append(str(exc))
    executor.close()
    return out


def test_the_next_step_is_launched_before_this_one_finishes() -> None:
    log: list[str] = []
    executor = ThreadExecutor(pipeline=True)
    results = _drive(executor, [two_phase_step(i, log) for i in range(4)])
    assert results == [[[i]] for i in range(4)]
    assert log == ["L0", "L1", "F0", "L2", "F1", "L3", "F2", "F3"]
    assert executor.num_pipelined == 3


def test_without_pipeline_each_step_runs_to_the_end() -> None:
    log: list[str] = []
    executor = ThreadExecutor()
    assert _drive(executor, [two_phase_step(i, log) for i in range(3)]) == [[[i]] for i in range(3)]
    assert log == ["L0", "F0", "L1", "F1", "L2", "F2"] and executor.num_pipelined == 0


def test_a_wait_finishes_the_held_step_when_nothing_follows() -> None:
    """The caller waits for step 0 before launching step 1 (an engine's flush): the
    worker must not hold 0 for a next step that is not coming."""
    log: list[str] = []
    executor = ThreadExecutor(pipeline=True)
    for i in range(2):
        pending = executor.launch(i, two_phase_step(i, log))
        got: list[Any] = []
        waiter = threading.Thread(target=lambda p=pending, out=got: out.append(executor.wait(p).token_ids),
                                  daemon=True)
        waiter.start()
        waiter.join(timeout=60)  # bounded: a worker that keeps the step would hang the wait
        assert got == [[[i]]], f"wait for step {i} did not return: {log}"
    executor.close()
    assert log == ["L0", "F0", "L1", "F1"] and executor.num_pipelined == 0


def test_a_step_that_reads_host_results_is_launched_after_the_one_before_finished() -> None:
    log: list[str] = []
    executor = ThreadExecutor(pipeline=True)
    runs = [two_phase_step(0, log), two_phase_step(1, log, pipelines=False), two_phase_step(2, log)]
    assert _drive(executor, runs) == [[[0]], [[1]], [[2]]]
    assert log == ["L0", "F0", "L1", "L2", "F1", "F2"]


def test_a_failed_finish_fails_only_its_step() -> None:
    log: list[str] = []
    runs = [two_phase_step(0, log), two_phase_step(1, log, fail_finish=True), two_phase_step(2, log)]
    assert _drive(ThreadExecutor(pipeline=True), runs) == [[[0]], "finish 1 failed", [[2]]]
    assert log == ["L0", "L1", "F0", "L2", "F1!", "F2"]


def test_a_failed_launch_fails_only_its_step_and_the_one_before_still_finishes() -> None:
    log: list[str] = []
    runs = [two_phase_step(0, log), two_phase_step(1, log, fail_launch=True), two_phase_step(2, log)]
    assert _drive(ThreadExecutor(pipeline=True), runs) == [[[0]], "launch 1 failed", [[2]]]
    assert log == ["L0", "L1!", "F0", "L2", "F2"]


def test_plain_callables_run_whole_between_two_phase_steps() -> None:
    log: list[str] = []

    def plain(i: int) -> Callable[[], StepResult]:
        def run() -> StepResult:
            log.append(f"P{i}")
            return StepResult(token_ids=[[i]])
        return run

    runs: list[Callable[[], StepResult]] = [plain(0), two_phase_step(1, log), two_phase_step(2, log), plain(3)]
    assert _drive(ThreadExecutor(pipeline=True), runs) == [[[i]] for i in range(4)]
    assert log == ["P0", "L1", "L2", "F1", "F2", "P3"]


def test_close_finishes_every_launched_step() -> None:
    """Steps launched and never waited for are finished by close (their results kept)."""
    log: list[str] = []
    executor = ThreadExecutor(pipeline=True)
    pending = [executor.launch(i, two_phase_step(i, log)) for i in range(3)]
    executor.close()
    executor.close()
    assert log == ["L0", "L1", "F0", "L2", "F1", "F2"]
    assert [executor.wait(p).token_ids for p in pending] == [[[0]], [[1]], [[2]]]


def test_the_worker_holds_a_step_until_the_caller_moves() -> None:
    """After launching step 0 the worker keeps it unfinished (it neither finishes it on
    its own nor spins): the finish happens only once the caller launches step 1, and
    step 1's launch comes first. Checked with events, not sleeps: step 1's launch
    blocks until the test has seen that step 0 was launched and not finished."""
    log: list[str] = []
    launched0, go = threading.Event(), threading.Event()

    def launch0() -> Callable[[], StepResult]:
        log.append("L0")
        launched0.set()
        return lambda: (log.append("F0"), StepResult(token_ids=[[0]]))[1]

    def launch1() -> Callable[[], StepResult]:
        go.wait(timeout=30)
        log.append("L1")
        return lambda: (log.append("F1"), StepResult(token_ids=[[1]]))[1]

    executor = ThreadExecutor(pipeline=True)
    p0 = executor.launch(0, TwoPhaseRun(lambda: launch0()(), launch0))
    assert launched0.wait(timeout=30)
    p1 = executor.launch(1, TwoPhaseRun(lambda: launch1()(), launch1))
    assert log == ["L0"]  # step 1 is queued, step 0 not finished
    go.set()
    assert executor.wait(p0).token_ids == [[0]] and executor.wait(p1).token_ids == [[1]]
    executor.close()
    assert log == ["L0", "L1", "F0", "F1"]


# ---- the CUDA stream executor, over fakes of torch.cuda (no GPU needed) -------------------


class _FakeStream:
    def __init__(self, *args: Any) -> None:
        self.waited = 0

    def wait_event(self, event: Any) -> None:
        self.waited += 1

    def synchronize(self) -> None:
        pass


class _FakeEvent:
    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Replaces the parts of ``torch.cuda`` the stream executor touches; yields the stack
    of streams entered (``torch.cuda.stream`` contexts) as steps see it."""
    entered: list[Any] = []

    @contextlib.contextmanager
    def stream(s: Any) -> Iterator[None]:
        entered.append(s)
        try:
            yield
        finally:
            entered.pop()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", stream)
    yield entered


@pytest.mark.parametrize("pipeline", [True, False])
def test_the_stream_executor_runs_both_phases_on_its_stream(fake_cuda: list[Any], pipeline: bool) -> None:
    from deepinfer_kit.overlap import CudaStreamExecutor

    executor = CudaStreamExecutor("cuda", pipeline=pipeline)
    log: list[str] = []

    def step(i: int, fail_launch: bool = False) -> TwoPhaseRun:
        inner = two_phase_step(i, log, fail_launch=fail_launch)

        def launch() -> Callable[[], StepResult]:
            assert fake_cuda == [executor.stream], "launched off the executor's stream"
            finish = inner.launch()

            def on_stream() -> StepResult:
                assert fake_cuda == [executor.stream], "finished off the executor's stream"
                return finish()
            return on_stream

        return TwoPhaseRun(lambda: launch()(), launch)

    results = _drive(executor, [step(0), step(1), step(2, fail_launch=True), step(3)])
    assert results == [[[0]], [[1]], "launch 2 failed", [[3]]]
    if pipeline:
        assert log == ["L0", "L1", "F0", "L2!", "F1", "L3", "F3"] and executor.num_pipelined == 1
    else:
        assert log == ["L0", "F0", "L1", "F1", "L2!", "L3", "F3"] and executor.num_pipelined == 0
    assert executor.stream.waited == 4  # each step after its inputs
    assert len(executor.alive) == 0  # closed: the stream was synchronised
