"""sched/: static and continuous batching, token budgets, chunked prefill, preemption."""

from deepinfer_kit.sched.protocols import Scheduler
from deepinfer_kit.sched.records import ScheduledChunk, SchedulePlan, SchedulerConfig, StepResult

__all__ = ["Scheduler", "SchedulerConfig", "ScheduledChunk", "SchedulePlan", "StepResult"]
