"""Static batching: a BatchScheduler whose batch runs until every member stops."""

from __future__ import annotations

import time
from collections.abc import Callable

from deepinfer_kit.cache.protocols import KVCacheManager
from deepinfer_kit.sched.batching import StaticBatching
from deepinfer_kit.sched.protocols import AdmissionPolicy, PreemptionPolicy
from deepinfer_kit.sched.records import SchedulerConfig
from deepinfer_kit.sched.scheduler import BatchScheduler

__all__ = ["StaticBatchScheduler"]


def StaticBatchScheduler(  # noqa: N802 - named like the scheduler it configures
    config: SchedulerConfig,
    cache: KVCacheManager,
    *,
    admission: AdmissionPolicy | None = None,
    victim: PreemptionPolicy | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> BatchScheduler:
    """A :class:`BatchScheduler` configured for static batching.

    Up to ``max_num_seqs`` requests are admitted (in ``admission`` order) once the
    previous batch has drained, and run to completion; each member keeps its identity
    and stops on its own. Admission reserves each member's whole life of blocks, so
    nothing is preempted (``victim`` is accepted and never called). Prompts are
    prefilled within the round's token budget (in chunks when
    ``enable_chunked_prefill``).
    """
    return BatchScheduler(
        config, cache, StaticBatching(), admission=admission, victim=victim, clock=clock
    )
