"""BlockKVCacheManager.allocate_next_blocks: one round's decode blocks in one call equal
the per-request ``allocate`` calls it stands for — the same blocks, evicted in the same
LRU order, the same counters — and a pool that runs short serves a prefix of the list."""

from __future__ import annotations

import pytest

from deepinfer_kit.cache.manager import BlockKVCacheManager
from deepinfer_kit.cache.records import CacheConfig
from deepinfer_kit.request import Request
from deepinfer_kit.testing.cache_slot_checks import allocate_one_by_one, next_blocks_world


def _world(seed: int, index: str) -> tuple[BlockKVCacheManager, list[Request]]:
    """The conformance suite's world (:func:`next_blocks_world`) over a manager with
    ``index``: finished requests left cached blocks behind (evictable, in some LRU order);
    live ones sit at a block boundary."""
    manager: BlockKVCacheManager | None = None

    def factory(num_blocks: int, block_size: int) -> BlockKVCacheManager:
        nonlocal manager
        manager = BlockKVCacheManager.create(
            CacheConfig(block_size=block_size, num_blocks=num_blocks), index=index)  # type: ignore[arg-type]
        return manager

    _, live = next_blocks_world(factory, seed)
    assert manager is not None
    return manager, live


@pytest.mark.parametrize("index", ["hash", "radix"])
@pytest.mark.parametrize("seed", range(12))
def test_equals_one_allocate_per_request(index: str, seed: int) -> None:
    bulk, reqs_a = _world(seed, index)
    step, reqs_b = _world(seed, index)
    got = bulk.allocate_next_blocks(reqs_a)
    assert got == allocate_one_by_one(step, reqs_b)
    assert [r.block_table for r in reqs_a] == [r.block_table for r in reqs_b]
    assert bulk.num_free_blocks == step.num_free_blocks
    assert bulk.stats == step.stats
    bulk.check_integrity(reqs_a)
    # What stays cached, and in which order it goes next, is the same too.
    rest = bulk.num_free_blocks - bulk.allocator.num_free
    assert bulk.index is not None and step.index is not None
    assert bulk.index.evict(rest) == step.index.evict(rest)


def test_pressure_is_real() -> None:
    # Some worlds above must evict and some must run short, or the test shows little.
    evicting = short = 0
    for seed in range(12):
        m, reqs = _world(seed, "hash")
        evicting += len(reqs) > m.allocator.num_free
        short += len(reqs) > m.num_free_blocks
        m.allocate_next_blocks(reqs)
    assert evicting > 0
