"""Fixtures of the scheduler tests: schedulers over a real BlockKVCacheManager."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from deepinfer_kit.cache.manager import BlockKVCacheManager
from deepinfer_kit.cache.records import CacheConfig
from deepinfer_kit.sched import ContinuousBatchScheduler, StaticBatchScheduler
from deepinfer_kit.sched.scheduler import BatchScheduler
from deepinfer_kit.cache.protocols import KVCacheManager
from deepinfer_kit.sched.protocols import SchedulerFactory
from deepinfer_kit.sched.records import SchedulerConfig

SCHEDULERS = {"continuous": ContinuousBatchScheduler, "static": StaticBatchScheduler}

CacheFactory = Callable[..., BlockKVCacheManager]
SchedFactory = Callable[..., BatchScheduler]


def _make_cache(num_blocks: int, block_size: int, index: str = "hash") -> BlockKVCacheManager:
    return BlockKVCacheManager.create(
        CacheConfig(block_size=block_size, num_blocks=num_blocks),
        index=index,  # type: ignore[arg-type]
    )


@pytest.fixture
def make_cache() -> CacheFactory:
    """``make_cache(num_blocks, block_size, index="hash")`` -> a real cache manager."""
    return _make_cache


@pytest.fixture
def suite_factory() -> Callable[[str, str], SchedulerFactory]:
    """``suite_factory(kind, index)`` -> the conformance-suite factory of that scheduler,
    over a cache of the suite's size with the named prefix index."""

    def build(kind: str, index: str) -> SchedulerFactory:
        make = SCHEDULERS[kind]

        def factory(config: SchedulerConfig, cache: KVCacheManager) -> BatchScheduler:
            return make(config, _make_cache(cache.num_blocks, cache.block_size, index))

        return factory

    return build


@pytest.fixture(params=sorted(SCHEDULERS))
def kind(request: pytest.FixtureRequest) -> str:
    """Each scheduler class by name."""
    return str(request.param)
