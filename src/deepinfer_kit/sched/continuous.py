"""Continuous batching: a BatchScheduler that admits every round and preempts by recompute."""

from __future__ import annotations

import time
from collections.abc import Callable

from deepinfer_kit.cache.protocols import KVCacheManager
from deepinfer_kit.sched.batching import ContinuousBatching
from deepinfer_kit.sched.protocols import AdmissionPolicy, PreemptionPolicy
from deepinfer_kit.sched.records import SchedulerConfig
from deepinfer_kit.sched.scheduler import BatchScheduler

__all__ = ["ContinuousBatchScheduler"]


def ContinuousBatchScheduler(  # noqa: N802 - named like the scheduler it configures
    config: SchedulerConfig,
    cache: KVCacheManager,
    *,
    admission: AdmissionPolicy | None = None,
    victim: PreemptionPolicy | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> BatchScheduler:
    """A :class:`BatchScheduler` configured for continuous batching.

    Each round every running request gets its next chunk (a decode token, or the next
    piece of its prefill capped by ``long_prefill_token_threshold`` and the budget left;
    victims chosen by ``victim`` are preempted by recompute when blocks run out), then
    waiting requests are admitted in ``admission`` order while the budget, the seats
    (``n`` for a request that will fork) and the blocks allow, each matching the prefix
    cache afresh. The queue head blocks the ones behind it (no overtaking).
    """
    return BatchScheduler(
        config, cache, ContinuousBatching(), admission=admission, victim=victim, clock=clock
    )
