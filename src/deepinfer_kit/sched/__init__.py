"""sched/: static and continuous batching, token budgets, chunked prefill, preemption."""

from deepinfer_kit.sched.batching import ContinuousBatching, StaticBatching
from deepinfer_kit.sched.continuous import ContinuousBatchScheduler
from deepinfer_kit.sched.policies import (
    fcfs_key,
    latest_arrival_victim,
    lowest_priority_victim,
    priority_key,
)
from deepinfer_kit.sched.protocols import (
    AdmissionPolicy,
    BatchingPolicy,
    DecodeStretches,
    PreemptionPolicy,
    Scheduler,
    SchedulerFactory,
)
from deepinfer_kit.sched.records import (
    DecodeChunk,
    DecodeRows,
    PlainDecodeRun,
    SamplingRow,
    ScheduledChunk,
    SchedulePlan,
    SchedulerConfig,
)
from deepinfer_kit.sched.scheduler import BatchScheduler
from deepinfer_kit.sched.static import StaticBatchScheduler
from deepinfer_kit.step import StepResult

__all__ = [
    "Scheduler",
    "SchedulerFactory",
    "AdmissionPolicy",
    "PreemptionPolicy",
    "BatchingPolicy",
    "DecodeStretches",
    "PlainDecodeRun",
    "SchedulerConfig",
    "ScheduledChunk",
    "DecodeChunk",
    "DecodeRows",
    "SamplingRow",
    "SchedulePlan",
    "StepResult",
    "BatchScheduler",
    "ContinuousBatching",
    "StaticBatching",
    "ContinuousBatchScheduler",
    "StaticBatchScheduler",
    "fcfs_key",
    "priority_key",
    "latest_arrival_victim",
    "lowest_priority_victim",
]
