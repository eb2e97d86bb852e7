"""ThreadExecutor: runs steps on one worker thread so the host can plan the next step."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from deepinfer_kit._validators import require_ints_at_least
from deepinfer_kit.errors import InvariantError
from deepinfer_kit.overlap.records import PendingStep
from deepinfer_kit.step import StepResult

if TYPE_CHECKING:
    from deepinfer_kit.overlap.protocols import OverlapExecutor

__all__ = ["ThreadExecutor"]


class ThreadExecutor:
    """Runs the device part of each step on a single worker thread, in launch order.

    With one worker, steps complete in the order they were launched; torch releases the
    GIL inside its kernels, so host-side scheduling proceeds while a CPU forward runs.
    Callers that launch step ``k + 1`` before waiting for step ``k`` must resolve the
    inputs that depend on step ``k``'s tokens inside ``run`` (placeholders).
    """

    def __init__(self, depth: int = 1) -> None:
        require_ints_at_least(1, depth=depth)
        self._depth = depth
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="deepinfer-step"
        )

    @property
    def depth(self) -> int:
        """Steps allowed in flight while the host schedules."""
        return self._depth

    def launch(self, step_id: int, run: Callable[[], StepResult]) -> PendingStep:
        """Queue ``run`` on the worker and return at once.

        Raises:
            InvariantError: the executor was closed.
        """
        if self._pool is None:
            raise InvariantError("launch on a closed ThreadExecutor")
        return PendingStep(step_id=step_id, handle=self._pool.submit(run))

    def wait(self, pending: PendingStep) -> StepResult:
        """Block until the step finished; re-raise its exception."""
        future = pending.handle
        if not isinstance(future, Future):
            raise TypeError(f"not a ThreadExecutor step: {pending!r}")
        result = future.result()
        if not isinstance(result, StepResult):
            raise TypeError(f"step {pending.step_id} returned {type(result).__name__}, not StepResult")
        return result

    def close(self) -> None:
        """Wait for queued steps and stop the worker. Idempotent."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


if TYPE_CHECKING:
    _check: type[OverlapExecutor] = ThreadExecutor
