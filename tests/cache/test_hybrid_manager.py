"""HybridKVCacheManager: the KVCacheManager suite through its groups (windows too long to
slide: every call passes through the sliding group's bookkeeping and must change nothing
the full group's manager decides), and the sliding-window suite (windows that slide)."""

from __future__ import annotations

import pytest

from deepinfer_kit.cache import BlockKVCacheManager, FreeListBlockAllocator, RadixPrefixIndex
from deepinfer_kit.cache.hash_chain_index import HashChainPrefixIndex
from deepinfer_kit.cache.hybrid_manager import HybridKVCacheManager
from deepinfer_kit.cache.layer_groups import KVLayout
from deepinfer_kit.testing.cache import KV_CACHE_MANAGER_SUITE
from deepinfer_kit.testing.hybrid_cache import HYBRID_KV_CACHE_MANAGER_SUITE
from deepinfer_kit.testing.suite import Check

INDEXES = {"hash": HashChainPrefixIndex, "radix": RadixPrefixIndex}


def _hybrid(kind: str, num_blocks: int, block_size: int, layout: KVLayout, sliding: int) -> HybridKVCacheManager:
    inner = BlockKVCacheManager(FreeListBlockAllocator(num_blocks, block_size), INDEXES[kind](block_size))
    return HybridKVCacheManager(inner, layout, sliding)


@pytest.mark.parametrize("check", KV_CACHE_MANAGER_SUITE.checks, ids=KV_CACHE_MANAGER_SUITE.ids)
def test_plain_manager_suite_through_the_groups(check: Check[object]) -> None:
    layout = KVLayout.from_windows([None, 10_000])
    check(lambda num_blocks, block_size: _hybrid("radix", num_blocks, block_size, layout, 4 * num_blocks + 4))


@pytest.mark.parametrize("kind", sorted(INDEXES))
@pytest.mark.parametrize("check", HYBRID_KV_CACHE_MANAGER_SUITE.checks, ids=HYBRID_KV_CACHE_MANAGER_SUITE.ids)
def test_sliding_window_suite(check: Check[object], kind: str) -> None:
    check(lambda num_blocks, block_size, layout, sliding: _hybrid(kind, num_blocks, block_size, layout, sliding))
