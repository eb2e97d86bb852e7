"""Both executors pass the OverlapExecutor conformance suite; the threaded one overlaps."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from deepinfer_kit import ConfigError
from deepinfer_kit import InvariantError
from deepinfer_kit.overlap import DeferredExecutor, OverlapExecutor, SyncExecutor, ThreadExecutor
from deepinfer_kit.sched import StepResult
from deepinfer_kit.testing import OVERLAP_EXECUTOR_SUITE
from deepinfer_kit.testing.suite import Check

FACTORIES: dict[str, Callable[[], OverlapExecutor]] = {
    "sync": SyncExecutor, "threaded": ThreadExecutor, "deferred": DeferredExecutor}


@pytest.mark.parametrize("name", sorted(FACTORIES))
@pytest.mark.parametrize("check", OVERLAP_EXECUTOR_SUITE, ids=OVERLAP_EXECUTOR_SUITE.ids)
def test_conformance(check: Check[Callable[[], OverlapExecutor]], name: str) -> None:
    check(FACTORIES[name])


@pytest.mark.cuda
@pytest.mark.parametrize("check", OVERLAP_EXECUTOR_SUITE, ids=OVERLAP_EXECUTOR_SUITE.ids)
def test_cuda_stream_executor_conformance(check: Check[Callable[[], OverlapExecutor]]) -> None:
    from deepinfer_kit.overlap import CudaStreamExecutor

    check(CudaStreamExecutor)


@pytest.mark.cuda
def test_cuda_stream_executor_orders_the_step_after_its_inputs() -> None:
    """A step reads a tensor the caller filled by a copy queued just before launch."""
    import torch

    from deepinfer_kit.overlap import CudaStreamExecutor

    executor = CudaStreamExecutor()
    big = torch.ones(1 << 24, device="cuda")
    target = torch.zeros(1 << 24, device="cuda")
    target.copy_(big * 3)  # queued on the caller's stream, not yet done
    pending = executor.launch(0, lambda: StepResult(token_ids=[[int(target[-1].item())]]))
    assert executor.wait(pending).token_ids == [[3]]
    executor.close()


def test_cuda_stream_executor_refuses_a_cpu_device() -> None:
    from deepinfer_kit import DeviceUnavailableError
    from deepinfer_kit.overlap import CudaStreamExecutor

    with pytest.raises(DeviceUnavailableError, match="needs a CUDA device, got 'cpu'"):
        CudaStreamExecutor("cpu")


def test_threaded_launch_returns_before_the_step_ends() -> None:
    """The step cannot end before launch has returned: it waits for an event the caller sets
    only after launch returned. A launch that runs the step itself is caught at once (the
    step runs on the caller's thread); one that blocks on the worker is caught when the
    step gives up waiting, and the step is then seen finished when launch returns."""
    launched, step_ended = threading.Event(), threading.Event()
    caller = threading.get_ident()
    seen: dict[str, bool] = {}
    executor = ThreadExecutor()

    def run() -> StepResult:
        seen["on_caller_thread"] = threading.get_ident() == caller
        seen["released_by_caller"] = not seen["on_caller_thread"] and launched.wait(timeout=5)
        step_ended.set()
        return StepResult(token_ids=[[7]])

    pending = executor.launch(0, run)
    blocked_while_launch_returned = not step_ended.is_set()
    launched.set()
    result = executor.wait(pending)
    executor.close()
    executor.close()
    assert blocked_while_launch_returned, f"launch returned only after the step ended: {seen}"
    assert seen == {"on_caller_thread": False, "released_by_caller": True}
    assert result.token_ids == [[7]]


def test_sync_depth_is_zero_and_threaded_depth_validated() -> None:
    assert SyncExecutor().depth == 0
    assert ThreadExecutor(depth=2).depth == 2
    with pytest.raises(ConfigError, match="depth must be an int >= 1, got 0"):
        ThreadExecutor(depth=0)


def test_deferred_runs_each_step_when_waited_for_and_in_launch_order() -> None:
    ran: list[int] = []

    def step(i: int) -> Callable[[], StepResult]:
        def run() -> StepResult:
            ran.append(i)
            return StepResult(token_ids=[[i]])
        return run

    executor = DeferredExecutor()
    first, second = executor.launch(0, step(0)), executor.launch(1, step(1))
    assert ran == [] and executor.depth == 1
    with pytest.raises(InvariantError, match="step 1 waited for before older steps"):
        executor.wait(second)
    assert executor.wait(first).token_ids == [[0]] and executor.wait(second).token_ids == [[1]]
    assert ran == [0, 1]
    executor.close()
    with pytest.raises(InvariantError, match="closed"):
        executor.launch(2, step(2))
