"""A user's Scheduler wrapper that forwards to another scheduler: mypy must accept it."""

from __future__ import annotations

from deepinfer_kit.outputs import RequestOutput
from deepinfer_kit.request import Request
from deepinfer_kit.sched import (
    BatchingPolicy,
    ContinuousBatching,
    SchedulePlan,
    Scheduler,
    StepResult,
)
from deepinfer_kit.sched.state import InflightPlan, SchedulerState


class LoggingScheduler:
    def __init__(self, inner: Scheduler) -> None:
        self.inner = inner
        self.rounds = 0

    @property
    def num_unfinished(self) -> int:
        return self.inner.num_unfinished

    def add(self, request: Request) -> None:
        self.inner.add(request)

    def never_fits(self, request: Request) -> str | None:
        return self.inner.never_fits(request)

    def abort(self, request_id: str) -> bool:
        return self.inner.abort(request_id)

    def schedule(self) -> SchedulePlan:
        self.rounds += 1
        return self.inner.schedule()

    def commit(self, plan: SchedulePlan, result: StepResult) -> list[RequestOutput]:
        return self.inner.commit(plan, result)

    def has_unfinished(self) -> bool:
        return self.inner.has_unfinished()


_check: type[Scheduler] = LoggingScheduler


class EveryOtherRound:
    """A batching policy of the user's: admit like continuous batching, on even rounds."""

    def __init__(self) -> None:
        self.inner = ContinuousBatching()
        self.rounds = 0

    @property
    def preemptive(self) -> bool:
        return True

    def never_fits(self, request: Request, state: SchedulerState) -> str | None:
        return None

    def admit(self, state: SchedulerState, entry: InflightPlan, budget: int, preempted: bool) -> int:
        self.rounds += 1
        return self.inner.admit(state, entry, budget, preempted) if self.rounds % 2 else budget


_policy: type[BatchingPolicy] = EveryOtherRound
