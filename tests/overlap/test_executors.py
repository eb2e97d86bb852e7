"""Both executors pass the OverlapExecutor conformance suite; the threaded one overlaps."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from deepinfer_kit import ConfigError
from deepinfer_kit.overlap import OverlapExecutor, SyncExecutor, ThreadExecutor
from deepinfer_kit.sched import StepResult
from deepinfer_kit.testing import OVERLAP_EXECUTOR_SUITE
from deepinfer_kit.testing.suite import Check

FACTORIES: dict[str, Callable[[], OverlapExecutor]] = {"sync": SyncExecutor, "threaded": ThreadExecutor}


@pytest.mark.parametrize("name", sorted(FACTORIES))
@pytest.mark.parametrize("check", OVERLAP_EXECUTOR_SUITE, ids=OVERLAP_EXECUTOR_SUITE.ids)
def test_conformance(check: Check[Callable[[], OverlapExecutor]], name: str) -> None:
    check(FACTORIES[name])


def test_threaded_launch_returns_before_the_step_ends() -> None:
    gate = threading.Event()
    executor = ThreadExecutor()

    def run() -> StepResult:
        gate.wait(timeout=5)
        return StepResult(token_ids=[[7]])

    pending = executor.launch(0, run)
    gate.set()  # reached only because launch did not block on the step
    assert executor.wait(pending).token_ids == [[7]]
    executor.close()
    executor.close()


def test_sync_depth_is_zero_and_threaded_depth_validated() -> None:
    assert SyncExecutor().depth == 0
    assert ThreadExecutor(depth=2).depth == 2
    with pytest.raises(ConfigError, match="depth must be an int >= 1, got 0"):
        ThreadExecutor(depth=0)
