"""Contract of the overlap package: the OverlapExecutor."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from deepinfer_kit.overlap.records import PendingStep
from deepinfer_kit.step import StepResult

__all__ = ["OverlapExecutor"]


class OverlapExecutor(Protocol):
    """Runs the device part of a step, possibly while the host plans the next one."""

    @property
    def depth(self) -> int:
        """Steps that may be in flight while the host schedules (0: synchronous)."""
        ...

    def launch(self, step_id: int, run: Callable[[], StepResult]) -> PendingStep:
        """Start ``run`` (forward plus sampling of one plan).

        Returns at once when ``depth > 0``; a synchronous executor runs it before
        returning. Steps complete in launch order. ``run`` may be a
        :class:`~deepinfer_kit.overlap.records.TwoPhaseRun`: an executor that pipelines
        may launch it before it finishes the step before (see there); any other calls it.
        """
        ...

    def wait(self, pending: PendingStep) -> StepResult:
        """Block until the step finished and return its result; re-raises its exception."""
        ...

    def close(self) -> None:
        """Wait for everything in flight and release workers. Idempotent."""
        ...
