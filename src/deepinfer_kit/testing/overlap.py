"""Conformance suite for OverlapExecutor."""

from __future__ import annotations

from collections.abc import Callable

from deepinfer_kit.overlap.protocols import OverlapExecutor
from deepinfer_kit.overlap.records import TwoPhaseRun
from deepinfer_kit.step import StepResult
from deepinfer_kit.testing.suite import Suite, expect

__all__ = ["ExecutorFactory", "OVERLAP_EXECUTOR_SUITE", "two_phase_step"]

ExecutorFactory = Callable[[], OverlapExecutor]
"""``factory()`` -> an executor."""

OVERLAP_EXECUTOR_SUITE: Suite[ExecutorFactory] = Suite("OverlapExecutor", "factory() -> OverlapExecutor")


def _constant_step(i: int) -> Callable[[], StepResult]:
    def run() -> StepResult:
        return StepResult(token_ids=[[i]])

    return run


@OVERLAP_EXECUTOR_SUITE.check
def check_results_return_in_launch_order(factory: ExecutorFactory) -> None:
    executor = factory()
    try:
        pending = [executor.launch(i, _constant_step(i)) for i in range(5)]
        results = [executor.wait(p).token_ids for p in pending]
    finally:
        executor.close()
    expect(results == [[[i]] for i in range(5)], f"results out of order: {results}")


@OVERLAP_EXECUTOR_SUITE.check
def check_wait_reraises(factory: ExecutorFactory) -> None:
    executor = factory()

    def boom() -> StepResult:
        raise RuntimeError("step failed")

    try:
        pending = executor.launch(0, boom)
        try:
            executor.wait(pending)
        except RuntimeError as exc:
            expect("step failed" in str(exc), f"wrong exception re-raised: {exc}")
        else:
            raise AssertionError("wait must re-raise the step's exception")
    finally:
        executor.close()


def two_phase_step(i: int, log: list[str], *, fail_launch: bool = False, fail_finish: bool = False,
                   pipelines: bool = True) -> TwoPhaseRun:
    """A :class:`TwoPhaseRun` whose result is ``[[i]]``; it appends ``"L{i}"`` to ``log``
    when launched and ``"F{i}"`` when finished (``"L{i}!"`` / ``"F{i}!"`` where it raises
    ``RuntimeError``, as asked). ``run`` is ``launch()()``."""

    def launch() -> Callable[[], StepResult]:
        log.append(f"L{i}!" if fail_launch else f"L{i}")
        if fail_launch:
            raise RuntimeError(f"launch {i} failed")

        def finish() -> StepResult:
            log.append(f"F{i}!" if fail_finish else f"F{i}")
            if fail_finish:
                raise RuntimeError(f"finish {i} failed")
            return StepResult(token_ids=[[i]])

        return finish

    return TwoPhaseRun(lambda: launch()(), launch, pipelines=pipelines)


@OVERLAP_EXECUTOR_SUITE.check
def check_two_phase_steps_complete_in_launch_order(factory: ExecutorFactory) -> None:
    executor = factory()
    log: list[str] = []
    try:
        pending = [executor.launch(i, two_phase_step(i, log, pipelines=i % 3 != 2)) for i in range(6)]
        results = [executor.wait(p).token_ids for p in pending]
    finally:
        executor.close()
    expect(results == [[[i]] for i in range(6)], f"results out of order: {results}")
    finishes = [e for e in log if e.startswith("F")]
    expect(finishes == [f"F{i}" for i in range(6)], f"steps finished out of launch order: {log}")
    expect(all(log.index(f"L{i}") < log.index(f"F{i}") for i in range(6)), f"finished before launched: {log}")


@OVERLAP_EXECUTOR_SUITE.check
def check_two_phase_failures_stay_on_their_step(factory: ExecutorFactory) -> None:
    """Step 0 fails in its finish, step 1 in its launch, step 2 not at all."""
    executor = factory()
    log: list[str] = []
    runs = [two_phase_step(0, log, fail_finish=True), two_phase_step(1, log, fail_launch=True),
            two_phase_step(2, log)]
    try:
        pending = [executor.launch(i, run) for i, run in enumerate(runs)]
        outcomes: list[str] = []
        for p in pending:
            try:
                outcomes.append(str(executor.wait(p).token_ids))
            except RuntimeError as exc:
                outcomes.append(str(exc))
    finally:
        executor.close()
    expect(outcomes == ["finish 0 failed", "launch 1 failed", "[[2]]"], f"failures on the wrong steps: {outcomes}")
    expect(log.index("F0!") < log.index("F2"), f"steps finished out of launch order: {log}")
