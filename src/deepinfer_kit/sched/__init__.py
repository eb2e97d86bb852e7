"""sched/: static and continuous batching, token budgets, chunked prefill, preemption."""

from deepinfer_kit.sched.continuous import ContinuousBatchScheduler
from deepinfer_kit.sched.policies import (
    fcfs_key,
    latest_arrival_victim,
    lowest_priority_victim,
    priority_key,
)
from deepinfer_kit.sched.protocols import AdmissionPolicy, PreemptionPolicy, Scheduler
from deepinfer_kit.sched.records import ScheduledChunk, SchedulePlan, SchedulerConfig, StepResult
from deepinfer_kit.sched.static import StaticBatchScheduler

__all__ = [
    "Scheduler",
    "AdmissionPolicy",
    "PreemptionPolicy",
    "SchedulerConfig",
    "ScheduledChunk",
    "SchedulePlan",
    "StepResult",
    "ContinuousBatchScheduler",
    "StaticBatchScheduler",
    "fcfs_key",
    "priority_key",
    "latest_arrival_victim",
    "lowest_priority_victim",
]
