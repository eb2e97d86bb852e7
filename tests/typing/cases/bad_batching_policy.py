"""A batching policy whose ``admit`` forgets the ``preempted`` flag: mypy --strict must
reject it."""

from __future__ import annotations

from deepinfer_kit.request import Request
from deepinfer_kit.sched import BatchingPolicy
from deepinfer_kit.sched.state import InflightPlan, SchedulerState


class ForgetfulBatching:
    @property
    def preemptive(self) -> bool:
        return True

    def never_fits(self, request: Request, state: SchedulerState) -> str | None:
        return None

    def admit(self, state: SchedulerState, entry: InflightPlan, budget: int) -> int:
        return budget


_check: type[BatchingPolicy] = ForgetfulBatching  # error: admit lacks ``preempted``
