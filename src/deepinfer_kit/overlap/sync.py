"""SyncExecutor: runs each step to completion inside ``launch`` (depth 0, the reference)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from deepinfer_kit.overlap.records import PendingStep
from deepinfer_kit.step import StepResult

if TYPE_CHECKING:
    from deepinfer_kit.overlap.protocols import OverlapExecutor

__all__ = ["SyncExecutor"]


@attrs.define(slots=True)
class _Outcome:
    result: StepResult | None
    error: BaseException | None


class SyncExecutor:
    """The synchronous executor: ``launch`` runs the step before returning.

    The host never schedules while a step is in flight, so no placeholders are needed.
    An exception raised by the step is stored and re-raised by :meth:`wait`, as an
    asynchronous executor would.
    """

    @property
    def depth(self) -> int:
        """0: nothing is ever in flight while the host schedules."""
        return 0

    def launch(self, step_id: int, run: Callable[[], StepResult]) -> PendingStep:
        """Run ``run()`` now and keep its result (or exception) for :meth:`wait`."""
        try:
            outcome = _Outcome(result=run(), error=None)
        except Exception as exc:  # noqa: BLE001 - re-raised by wait(), like an async executor
            outcome = _Outcome(result=None, error=exc)
        return PendingStep(step_id=step_id, handle=outcome)

    def wait(self, pending: PendingStep) -> StepResult:
        """Return the launched step's result; re-raise its exception."""
        outcome = pending.handle
        if not isinstance(outcome, _Outcome):
            raise TypeError(f"not a SyncExecutor step: {pending!r}")
        if outcome.error is not None:
            raise outcome.error
        assert outcome.result is not None
        return outcome.result

    def close(self) -> None:
        """Nothing to release."""


if TYPE_CHECKING:
    _check: type[OverlapExecutor] = SyncExecutor
