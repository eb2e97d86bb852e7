"""build_host_components: the scheduler and KV cache manager an EngineConfig names, with
no model and no torch — shared by ``build_engine`` and the simulator."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal, cast

from deepinfer_kit.cache.manager import BlockKVCacheManager
from deepinfer_kit.cache.protocols import KVCacheManager
from deepinfer_kit.cache.records import CacheConfig
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.sched.continuous import ContinuousBatchScheduler
from deepinfer_kit.sched.protocols import Scheduler, SchedulerFactory
from deepinfer_kit.sched.records import SchedulerConfig
from deepinfer_kit.sched.static import StaticBatchScheduler

__all__ = ["build_host_components"]


def build_host_components(
    config: EngineConfig,
    *,
    num_blocks: int,
    max_model_len: int,
    make_scheduler: SchedulerFactory | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[Scheduler, KVCacheManager]:
    """The KV cache manager (block pool and prefix index) and the scheduler of ``config``.

    Called once per engine (or simulation) build; mutates nothing. ``clock`` stamps the
    request metrics of the default schedulers (the simulator passes its virtual clock); a
    ``make_scheduler`` factory receives only the scheduler config and the cache manager.

    Raises:
        ConfigError: a field the scheduler or cache config rejects (names field and value).
    """
    cache = BlockKVCacheManager.create(
        CacheConfig(block_size=config.block_size, num_blocks=num_blocks,
                    enable_prefix_caching=config.enable_prefix_caching),
        index=cast(Literal["hash", "radix"], config.prefix_index),
    )
    sched_config = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        policy=config.scheduler_policy,
    )
    scheduler: Scheduler
    if make_scheduler is not None:
        scheduler = make_scheduler(sched_config, cache)
    elif config.scheduler == "static":
        scheduler = StaticBatchScheduler(sched_config, cache, clock=clock)
    else:
        scheduler = ContinuousBatchScheduler(sched_config, cache, clock=clock)
    return scheduler, cache
