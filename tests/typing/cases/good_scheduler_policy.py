"""A user's Scheduler wrapper that forwards to another scheduler: mypy must accept it."""

from __future__ import annotations

from deepinfer_kit.outputs import RequestOutput
from deepinfer_kit.request import Request
from deepinfer_kit.sched import SchedulePlan, Scheduler, StepResult


class LoggingScheduler:
    def __init__(self, inner: Scheduler) -> None:
        self.inner = inner
        self.rounds = 0

    @property
    def num_unfinished(self) -> int:
        return self.inner.num_unfinished

    def add(self, request: Request) -> None:
        self.inner.add(request)

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
