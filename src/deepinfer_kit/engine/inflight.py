"""The engine's record of a round in flight, and the result that fails a whole round."""

from __future__ import annotations

import attrs

from deepinfer_kit.overlap.records import PendingStep
from deepinfer_kit.sched.records import SchedulePlan
from deepinfer_kit.step import StepResult

__all__ = ["InFlight", "failed_result"]


@attrs.define(slots=True, eq=False)
class InFlight:
    """A round scheduled and launched, not yet committed (with what its trace needs)."""

    plan: SchedulePlan
    launched: PendingStep | StepResult
    free_before: int
    evicted_before: int
    t0: float
    t1: float


def failed_result(plan: SchedulePlan, message: str) -> StepResult:
    """A result that fails every chunk of ``plan`` with ``message``."""
    n = len(plan.chunks)
    return StepResult(token_ids=[[] for _ in range(n)], errors=[message] * n)
