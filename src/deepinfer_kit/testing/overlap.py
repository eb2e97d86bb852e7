"""Conformance suite for OverlapExecutor."""

from __future__ import annotations

from collections.abc import Callable

from deepinfer_kit.overlap.protocols import OverlapExecutor
from deepinfer_kit.step import StepResult
from deepinfer_kit.testing.suite import Suite, expect

__all__ = ["ExecutorFactory", "OVERLAP_EXECUTOR_SUITE"]

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
