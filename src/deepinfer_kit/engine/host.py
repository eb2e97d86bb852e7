"""build_host_components: the KV cache manager and the scheduler of an EngineConfig, each
part the injected one (:class:`~deepinfer_kit.components.Components`) or the
built-in its config names — with no model and no torch; shared by ``build_engine``, the
simulator and the runner suite."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from deepinfer_kit.cache.free_list_allocator import FreeListBlockAllocator
from deepinfer_kit.cache.hybrid_manager import HybridKVCacheManager
from deepinfer_kit.cache.manager import BlockKVCacheManager
from deepinfer_kit.cache.protocols import BlockAllocator, KVCacheManager, PrefixIndex
from deepinfer_kit.cache.tiers.hybrid import TieredHybridKVCacheManager
from deepinfer_kit.cache.tiers.manager import TieredKVCacheManager
from deepinfer_kit.components import BuildContext, Components, build
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sched.batching import ContinuousBatching, StaticBatching
from deepinfer_kit.sched.protocols import BatchingPolicy, Scheduler
from deepinfer_kit.sched.records import SchedulerConfig
from deepinfer_kit.sched.scheduler import BatchScheduler

if TYPE_CHECKING:
    from collections.abc import Sequence

    from deepinfer_kit.cache.protocols import EvictionPolicy
    from deepinfer_kit.cache.tiers.protocols import KVConnectorScheduler

__all__ = ["build_host_components", "scheduler_config"]


def scheduler_config(config: EngineConfig, max_model_len: int) -> SchedulerConfig:
    """The scheduler's limits of ``config`` (its round budget, seats, length limit, policy)."""
    return SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        policy=config.scheduler_policy,
    )


def build_host_components(
    config: EngineConfig,
    *,
    num_blocks: int,
    max_model_len: int,
    components: Components | None = None,
    clock: Callable[[], float] = time.monotonic,
    windows: Sequence[int | None] = (),
    connector: KVConnectorScheduler | None = None,
) -> tuple[Scheduler, KVCacheManager]:
    """The KV cache manager (block pool and prefix index) and the scheduler of ``config``,
    ``components`` replacing the built-ins part by part.

    Called once per engine (or simulation) build. ``clock`` stamps the request metrics of
    the built-in schedulers (the simulator passes its virtual clock) and reaches every
    factory (:class:`BuildContext`). The scheduler built is checked to talk to the very
    cache manager returned (the one the engine's trace, idle check and
    ``reset_prefix_cache`` read). ``windows``: the model's per-layer sliding windows
    (``ModelConfig.sliding_windows``); with one set and ``config.hybrid_kv_cache`` the
    manager is wrapped in a :class:`HybridKVCacheManager` over its layer groups.
    ``connector``: the scheduler side of ``config.kv_tiers`` (built beside the device
    pool); the manager is then a :class:`TieredKVCacheManager` over it (wrapped in a
    :class:`TieredHybridKVCacheManager` for a hybrid cache: the tiers keep the windows).

    Raises:
        ConfigError: a field the scheduler or cache config rejects, a component of the
            wrong geometry (an allocator of another size, an index of another block size),
            a prefix index with prefix caching off, or a scheduler over another cache
            manager (each names the component and the values).
    """
    parts = components if components is not None else Components()
    ctx = BuildContext(config=config, clock=clock, block_size=config.block_size, num_blocks=num_blocks,
                       max_model_len=max_model_len)
    layout = config.kv_layout(windows)
    if connector is not None:
        if parts.cache_manager is not None:
            raise ConfigError("kv_tiers with components.cache_manager is not built yet: the tiers wrap the "
                              "built-in full-attention manager")
    cache = _cache_manager(config, parts, ctx, connector)
    if layout is not None and not hasattr(cache, "drain_table_updates"):
        sizes, limit = config.sliding_pool_sizes(layout), config.replay_limit()
        if isinstance(cache, TieredKVCacheManager):  # the tiers keep each block's windows too
            cache = TieredHybridKVCacheManager(cache, layout, sizes, replay_limit=limit)
        else:
            cache = HybridKVCacheManager(cache, layout, sizes, replay_limit=limit)
    sched_config = scheduler_config(config, max_model_len)
    ctx = attrs.evolve(ctx, cache=cache, scheduler_config=sched_config)
    scheduler = build(parts.scheduler, ctx)
    if scheduler is None:
        batching: BatchingPolicy | None = build(parts.batching_policy, ctx)
        if batching is None:
            batching = StaticBatching() if config.scheduler == "static" else ContinuousBatching()
        scheduler = BatchScheduler(sched_config, cache, batching, admission=build(parts.admission_policy, ctx),
                                   victim=build(parts.preemption_policy, ctx), clock=clock)
    own = getattr(scheduler, "cache", cache)
    if own is not cache:
        raise ConfigError(
            "components.scheduler talks to a KV cache manager of its own; the engine's trace, idle "
            "check and reset_prefix_cache read the engine's: build the scheduler over "
            "BuildContext.cache, and inject a cache of yours as components.cache_manager")
    return scheduler, cache


def _cache_manager(config: EngineConfig, parts: Components, ctx: BuildContext,
                   connector: KVConnectorScheduler | None = None) -> KVCacheManager:
    """The injected cache manager, or the built-in over the injected (or built-in)
    allocator, prefix index and eviction policy, each checked against the pool (a tiered
    one over ``connector`` when given)."""
    num_blocks, block_size = ctx.num_blocks, ctx.block_size
    cache = build(parts.cache_manager, ctx)
    if cache is not None:
        _check_geometry("cache_manager", cache.num_blocks, cache.block_size, num_blocks, block_size)
        return cache
    allocator: BlockAllocator | None = build(parts.block_allocator, ctx)
    if allocator is None:
        assert num_blocks is not None
        allocator = FreeListBlockAllocator(num_blocks, block_size)
    _check_geometry("block_allocator", allocator.num_blocks, allocator.block_size, num_blocks, block_size)
    index: PrefixIndex | None = build(parts.prefix_index, ctx)
    policy: EvictionPolicy | None = build(parts.eviction_policy, ctx)
    if not config.enable_prefix_caching:
        if index is not None or policy is not None:
            raise ConfigError("components.prefix_index / eviction_policy given with "
                              "enable_prefix_caching=False: turn prefix caching on to use them")
        return BlockKVCacheManager(allocator, None)
    if index is None:
        index = _named_index(config.prefix_index, block_size, policy)
    if connector is not None:
        key = config.kv_tiers.hash_key if config.kv_tiers is not None else getattr(connector, "hash_key", None)
        return TieredKVCacheManager(allocator, index, connector, hash_key=key)
    if index.block_size != block_size:
        raise ConfigError(f"components.prefix_index has block_size {index.block_size}, the engine's "
                          f"blocks hold {block_size} tokens")
    return BlockKVCacheManager(allocator, index)


def _named_index(name: str, block_size: int, policy: EvictionPolicy | None) -> PrefixIndex:
    """The built-in prefix index ``name`` (``"radix"`` or ``"hash"``) over ``policy``."""
    from deepinfer_kit.cache.hash_chain_index import HashChainPrefixIndex
    from deepinfer_kit.cache.radix_index import RadixPrefixIndex

    cls = HashChainPrefixIndex if name == "hash" else RadixPrefixIndex
    return cls(block_size, policy=policy)


def _check_geometry(kind: str, blocks: int, size: int, num_blocks: int | None, block_size: int) -> None:
    if (num_blocks is not None and blocks != num_blocks) or size != block_size:
        raise ConfigError(
            f"components.{kind} holds {blocks} blocks of {size} tokens; the engine's pool is "
            f"{num_blocks} blocks of {block_size} (build it in a Factory from BuildContext.num_blocks "
            f"and block_size)")
