"""An OverlapExecutor whose ``launch`` takes the wrong arguments: mypy must reject it."""

from __future__ import annotations

from collections.abc import Callable

from deepinfer_kit.overlap import OverlapExecutor, PendingStep
from deepinfer_kit.sched import StepResult


class WrongExecutor:
    @property
    def depth(self) -> int:
        return 0

    def launch(self, run: Callable[[], StepResult]) -> PendingStep:
        return PendingStep(step_id=0, handle=run())

    def wait(self, pending: PendingStep) -> StepResult:
        assert isinstance(pending.handle, StepResult)
        return pending.handle

    def close(self) -> None:
        pass


_check: type[OverlapExecutor] = WrongExecutor  # error: launch lacks step_id
