"""The continuous scheduler, over both prefix indexes, passes the DecodeStretches suite:
a stretch of plain-decode rounds applied at once leaves the requests, the cache and every
later decision as the rounds themselves do."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from deepinfer_kit.cache.manager import BlockKVCacheManager
from deepinfer_kit.cache.records import CacheConfig
from deepinfer_kit.sched import ContinuousBatchScheduler
from deepinfer_kit.sched.records import SchedulerConfig
from deepinfer_kit.sched.scheduler import BatchScheduler
from deepinfer_kit.testing.sched_stretch import DECODE_STRETCHES_SUITE


@pytest.mark.parametrize("index", ["hash", "radix"])
@pytest.mark.parametrize("check", list(DECODE_STRETCHES_SUITE), ids=DECODE_STRETCHES_SUITE.ids)
def test_stretch_conformance(check: Any, index: str) -> None:
    def factory(config: SchedulerConfig, num_blocks: int, block_size: int,
                clock: Callable[[], float]) -> tuple[BatchScheduler, BlockKVCacheManager]:
        cache = BlockKVCacheManager.create(
            CacheConfig(block_size=block_size, num_blocks=num_blocks), index=index  # type: ignore[arg-type]
        )
        return ContinuousBatchScheduler(config, cache, clock=clock), cache

    check(factory)
