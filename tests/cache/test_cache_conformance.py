"""Every cache implementation here passes its conformance suite from deepinfer_kit.testing."""

from __future__ import annotations

import pytest

from deepinfer_kit.cache import (
    BlockKVCacheManager,
    FreeListBlockAllocator,
    HashChainPrefixIndex,
    RadixPrefixIndex,
)
from deepinfer_kit.testing.cache import (
    BLOCK_ALLOCATOR_SUITE,
    KV_CACHE_MANAGER_SUITE,
    PREFIX_INDEX_SUITE,
)
from deepinfer_kit.testing.suite import Check

INDEXES = {"hash": HashChainPrefixIndex, "radix": RadixPrefixIndex}


@pytest.mark.parametrize("check", BLOCK_ALLOCATOR_SUITE.checks, ids=BLOCK_ALLOCATOR_SUITE.ids)
def test_free_list_allocator(check: Check[object]) -> None:
    check(FreeListBlockAllocator)


@pytest.mark.parametrize("kind", sorted(INDEXES))
@pytest.mark.parametrize("check", PREFIX_INDEX_SUITE.checks, ids=PREFIX_INDEX_SUITE.ids)
def test_prefix_index(check: Check[object], kind: str) -> None:
    check(lambda block_size: INDEXES[kind](block_size))


@pytest.mark.parametrize("kind", sorted(INDEXES))
@pytest.mark.parametrize("check", KV_CACHE_MANAGER_SUITE.checks, ids=KV_CACHE_MANAGER_SUITE.ids)
def test_block_kv_cache_manager(check: Check[object], kind: str) -> None:
    check(
        lambda num_blocks, block_size: BlockKVCacheManager(
            FreeListBlockAllocator(num_blocks, block_size), INDEXES[kind](block_size)
        )
    )
