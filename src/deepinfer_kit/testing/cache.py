"""Conformance suites for BlockAllocator and PrefixIndex."""

from __future__ import annotations

from collections.abc import Callable

from deepinfer_kit.cache.protocols import BlockAllocator, PrefixIndex
from deepinfer_kit.errors import OutOfBlocksError
from deepinfer_kit.testing.suite import Suite, expect

__all__ = ["AllocatorFactory", "PrefixIndexFactory", "BLOCK_ALLOCATOR_SUITE", "PREFIX_INDEX_SUITE"]

AllocatorFactory = Callable[[int, int], BlockAllocator]
"""``factory(num_blocks, block_size)`` -> a fresh, empty allocator."""

PrefixIndexFactory = Callable[[int], PrefixIndex]
"""``factory(block_size)`` -> a fresh, empty prefix index."""

BLOCK_ALLOCATOR_SUITE: Suite[AllocatorFactory] = Suite(
    "BlockAllocator", "factory(num_blocks, block_size) -> BlockAllocator"
)
PREFIX_INDEX_SUITE: Suite[PrefixIndexFactory] = Suite(
    "PrefixIndex", "factory(block_size) -> PrefixIndex"
)


@BLOCK_ALLOCATOR_SUITE.check
def check_fresh_pool_is_all_free(factory: AllocatorFactory) -> None:
    alloc = factory(8, 4)
    expect(alloc.num_blocks == 8, f"num_blocks: expected 8, got {alloc.num_blocks}")
    expect(alloc.block_size == 4, f"block_size: expected 4, got {alloc.block_size}")
    expect(alloc.num_free == 8, f"num_free of a fresh pool: expected 8, got {alloc.num_free}")


@BLOCK_ALLOCATOR_SUITE.check
def check_allocate_gives_distinct_referenced_blocks(factory: AllocatorFactory) -> None:
    alloc = factory(8, 4)
    blocks = alloc.allocate(5)
    expect(len(set(blocks)) == 5, f"allocate(5) returned duplicates: {blocks}")
    expect(all(0 <= b < 8 for b in blocks), f"block ids out of range: {blocks}")
    expect(all(alloc.ref_count(b) == 1 for b in blocks), "fresh blocks must have ref count 1")
    expect(alloc.num_free == 3, f"num_free after allocating 5 of 8: got {alloc.num_free}")


@BLOCK_ALLOCATOR_SUITE.check
def check_failed_allocation_changes_nothing(factory: AllocatorFactory) -> None:
    alloc = factory(4, 2)
    held = alloc.allocate(3)
    try:
        alloc.allocate(2)
    except OutOfBlocksError:
        pass
    else:
        raise AssertionError("allocate(2) with 1 free block must raise OutOfBlocksError")
    expect(alloc.num_free == 1, f"a failed allocation changed num_free to {alloc.num_free}")
    expect([alloc.ref_count(b) for b in held] == [1, 1, 1], "a failed allocation changed counts")


@PREFIX_INDEX_SUITE.check
def check_empty_index_misses(factory: PrefixIndexFactory) -> None:
    index = factory(4)
    expect(index.match(list(range(16))) == [], "an empty index must match nothing")
    expect(index.num_evictable == 0, "an empty index has nothing to evict")
    expect(index.evict(3) == [], "evict on an empty index must return []")
