"""Conformance suite for Scheduler."""

from __future__ import annotations

from collections.abc import Callable

from deepinfer_kit.sched.protocols import Scheduler
from deepinfer_kit.sched.records import SchedulerConfig, StepResult
from deepinfer_kit.testing.suite import Suite, expect

__all__ = ["SchedulerFactory", "SCHEDULER_SUITE"]

SchedulerFactory = Callable[[SchedulerConfig, int, int], Scheduler]
"""``factory(config, num_blocks, block_size)`` -> a scheduler over a fresh KV cache of that
size."""

SCHEDULER_SUITE: Suite[SchedulerFactory] = Suite(
    "Scheduler", "factory(config, num_blocks, block_size) -> Scheduler"
)


@SCHEDULER_SUITE.check
def check_empty_scheduler_is_idle(factory: SchedulerFactory) -> None:
    sched = factory(SchedulerConfig(), 16, 4)
    expect(not sched.has_unfinished(), "a fresh scheduler must have nothing unfinished")
    expect(sched.num_unfinished == 0, f"num_unfinished: expected 0, got {sched.num_unfinished}")
    plan = sched.schedule()
    expect(plan.is_empty, "an empty scheduler must plan an empty round")
    expect(sched.commit(plan, StepResult(token_ids=[])) == [], "committing nothing reports nothing")
