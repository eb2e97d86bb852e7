"""Conformance suites for BlockAllocator, PrefixIndex and KVCacheManager (the allocator's
checks live here; the others in cache_index_checks.py and cache_manager_checks.py)."""

from __future__ import annotations

import random
from collections.abc import Callable

from deepinfer_kit.cache.protocols import BlockAllocator, EvictionPolicy, KVCacheManager, PrefixIndex
from deepinfer_kit.errors import InvariantError, OutOfBlocksError
from deepinfer_kit.testing.cache_index_checks import register_index_checks
from deepinfer_kit.testing.cache_manager_checks import register_manager_checks
from deepinfer_kit.testing.cache_slot_checks import register_slot_checks
from deepinfer_kit.testing.eviction import LRUModel
from deepinfer_kit.testing.suite import Suite, expect

__all__ = [
    "AllocatorFactory",
    "PrefixIndexFactory",
    "KVCacheManagerFactory",
    "BLOCK_ALLOCATOR_SUITE",
    "PREFIX_INDEX_SUITE",
    "KV_CACHE_MANAGER_SUITE",
    "prefix_index_suite",
    "kv_cache_manager_suite",
]

AllocatorFactory = Callable[[int, int], BlockAllocator]
"""``factory(num_blocks, block_size)`` -> a fresh, empty allocator."""

PrefixIndexFactory = Callable[[int], PrefixIndex]
"""``factory(block_size)`` -> a fresh, empty prefix index (evicting in the order of the
suite's reference policy: LRU for :data:`PREFIX_INDEX_SUITE`)."""

KVCacheManagerFactory = Callable[[int, int], KVCacheManager]
"""``factory(num_blocks, block_size)`` -> a fresh manager with prefix caching on."""


def prefix_index_suite(reference: Callable[[], EvictionPolicy] = LRUModel) -> Suite[PrefixIndexFactory]:
    """The PrefixIndex suite with the eviction order of policies ``reference()`` builds
    (a fresh one per check, driven with the calls the index should make to its own): pass
    your policy's class to check an index that evicts in its order (an LFU index against
    an LFU reference). ``PREFIX_INDEX_SUITE`` is ``prefix_index_suite()`` (exact LRU)."""
    name = "PrefixIndex" if reference is LRUModel else f"PrefixIndex[{getattr(reference, '__name__', 'reference')}]"
    suite: Suite[PrefixIndexFactory] = Suite(name, "factory(block_size) -> PrefixIndex")
    register_index_checks(suite, reference)
    return suite


def kv_cache_manager_suite(reference: Callable[[], EvictionPolicy] = LRUModel) -> Suite[KVCacheManagerFactory]:
    """The KVCacheManager suite whose model evicts in the order of policies ``reference()``
    builds (``KV_CACHE_MANAGER_SUITE`` is ``kv_cache_manager_suite()``, exact LRU)."""
    name = "KVCacheManager" if reference is LRUModel else f"KVCacheManager[{getattr(reference, '__name__', 'reference')}]"
    suite: Suite[KVCacheManagerFactory] = Suite(name, "factory(num_blocks, block_size) -> KVCacheManager")
    register_manager_checks(suite, reference)
    register_slot_checks(suite)
    return suite


BLOCK_ALLOCATOR_SUITE: Suite[AllocatorFactory] = Suite(
    "BlockAllocator", "factory(num_blocks, block_size) -> BlockAllocator"
)
PREFIX_INDEX_SUITE: Suite[PrefixIndexFactory] = prefix_index_suite()
KV_CACHE_MANAGER_SUITE: Suite[KVCacheManagerFactory] = kv_cache_manager_suite()


def _raises(exc: type[Exception], fn: Callable[[], object], what: str) -> None:
    try:
        fn()
    except exc:
        return
    raise AssertionError(f"{what} must raise {exc.__name__}")


def _counts(alloc: BlockAllocator) -> list[int]:
    return [alloc.ref_count(b) for b in range(alloc.num_blocks)]


# ---------------------------------------------------------------- BlockAllocator


@BLOCK_ALLOCATOR_SUITE.check
def check_fresh_pool_is_all_free(factory: AllocatorFactory) -> None:
    alloc = factory(8, 4)
    expect(alloc.num_blocks == 8, f"num_blocks: expected 8, got {alloc.num_blocks}")
    expect(alloc.block_size == 4, f"block_size: expected 4, got {alloc.block_size}")
    expect(alloc.num_free == 8, f"num_free of a fresh pool: expected 8, got {alloc.num_free}")
    expect(_counts(alloc) == [0] * 8, "every block of a fresh pool has count 0")


@BLOCK_ALLOCATOR_SUITE.check
def check_allocate_gives_distinct_referenced_blocks(factory: AllocatorFactory) -> None:
    alloc = factory(8, 4)
    blocks = alloc.allocate(5)
    expect(len(set(blocks)) == 5, f"allocate(5) returned duplicates: {blocks}")
    expect(all(0 <= b < 8 for b in blocks), f"block ids out of range: {blocks}")
    expect(all(alloc.ref_count(b) == 1 for b in blocks), "fresh blocks must have ref count 1")
    expect(alloc.num_free == 3, f"num_free after allocating 5 of 8: got {alloc.num_free}")
    expect(alloc.allocate(0) == [], "allocate(0) must return []")
    _raises(InvariantError, lambda: alloc.allocate(-1), "allocate(-1)")


@BLOCK_ALLOCATOR_SUITE.check
def check_failed_allocation_changes_nothing(factory: AllocatorFactory) -> None:
    alloc = factory(4, 2)
    held = alloc.allocate(3)
    before = _counts(alloc)
    _raises(OutOfBlocksError, lambda: alloc.allocate(2), "allocate(2) with 1 free block")
    expect(alloc.num_free == 1, f"a failed allocation changed num_free to {alloc.num_free}")
    expect(_counts(alloc) == before, "a failed allocation changed counts")
    (last,) = alloc.allocate(1)
    expect(last not in held, "the remaining free block must still be allocatable")


@BLOCK_ALLOCATOR_SUITE.check
def check_retain_release_free_cycle(factory: AllocatorFactory) -> None:
    alloc = factory(4, 2)
    a, b = alloc.allocate(2)
    alloc.retain([a, b, a])
    expect((alloc.ref_count(a), alloc.ref_count(b)) == (3, 2), "retain adds one per mention")
    expect(alloc.release([a, b]) == [], "no count reached 0 yet")
    zero = alloc.release([b, a, a])
    expect(zero == [b, a], f"release returns the blocks reaching 0 in order, got {zero}")
    expect(alloc.num_free == 2, "released blocks stay held until freed")
    alloc.free([a, b])
    expect(alloc.num_free == 4, f"free returns blocks to the pool, num_free={alloc.num_free}")
    expect(sorted(alloc.allocate(4)) == [0, 1, 2, 3], "every block comes back exactly once")


@BLOCK_ALLOCATOR_SUITE.check
def check_bad_calls_raise_and_change_nothing(factory: AllocatorFactory) -> None:
    alloc = factory(4, 2)
    a, b = alloc.allocate(2)
    alloc.release([b])
    before = (_counts(alloc), alloc.num_free)
    free_block = next(x for x in range(4) if x not in (a, b))
    cases: list[tuple[str, Callable[[], object]]] = [
        ("retain of a free block", lambda: alloc.retain([a, free_block])),
        ("retain of an out-of-range block", lambda: alloc.retain([a, 4])),
        ("retain of a negative block id", lambda: alloc.retain([a, -4 + a])),
        ("release of a negative block id", lambda: alloc.release([-4 + a])),
        ("release of an out-of-range block", lambda: alloc.release([a, 4])),
        ("free of a negative block id", lambda: alloc.free([-4 + b])),
        ("release of an unreferenced block", lambda: alloc.release([a, b])),
        ("free of a referenced block", lambda: alloc.free([a])),
        ("free of a block given twice", lambda: alloc.free([b, b])),
        ("free of a free block", lambda: alloc.free([free_block])),
        ("make_writable of an unreferenced block", lambda: alloc.make_writable(b)),
        ("ref_count out of range", lambda: alloc.ref_count(-1)),
    ]
    for what, call in cases:
        _raises(InvariantError, call, what)
        expect((_counts(alloc), alloc.num_free) == before, f"{what} changed the allocator")
    alloc.free([b])
    _raises(InvariantError, lambda: alloc.free([b]), "a double free")
    expect(alloc.num_free == 3, "a rejected double free must not list the block twice")


@BLOCK_ALLOCATOR_SUITE.check
def check_make_writable_copies_only_shared_blocks(factory: AllocatorFactory) -> None:
    alloc = factory(3, 2)
    (a,) = alloc.allocate(1)
    expect(alloc.make_writable(a) == (a, None), "a sole holder writes in place")
    alloc.retain([a])
    new, src = alloc.make_writable(a)
    expect(src == a and new != a, f"a shared block must be copied, got ({new}, {src})")
    expect((alloc.ref_count(a), alloc.ref_count(new)) == (1, 1), "the copy moves one reference")
    alloc.allocate(1)
    alloc.retain([a])
    before = (_counts(alloc), alloc.num_free)
    _raises(OutOfBlocksError, lambda: alloc.make_writable(a), "make_writable with no free block")
    expect((_counts(alloc), alloc.num_free) == before, "a failed make_writable changed state")


@BLOCK_ALLOCATOR_SUITE.check
def check_random_operations_against_shadow(factory: AllocatorFactory) -> None:
    rng = random.Random(1234)
    n = 12
    alloc = factory(n, 4)
    shadow: dict[int, int] = {}  # held block -> count
    for step in range(2000):
        op = rng.randrange(5)
        held = list(shadow)
        free_before = n - len(shadow)
        k = rng.randrange(4)
        try:
            if op == 0:
                got = alloc.allocate(k)
                expect(k <= n - len(shadow), f"step {step}: allocate({k}) beyond the free pool")
                expect(not set(got) & set(shadow), f"step {step}: allocated held blocks {got}")
                shadow.update(dict.fromkeys(got, 1))
            elif op == 1 and held:
                pick = rng.sample(held, min(len(held), 2))
                alloc.retain(pick)
                for b in pick:
                    shadow[b] += 1
            elif op == 2 and held:
                pick = [b for b in rng.sample(held, min(len(held), 3)) if shadow[b] > 0]
                zero = alloc.release(pick)
                for b in pick:
                    shadow[b] -= 1
                expect(zero == [b for b in pick if shadow[b] == 0], f"step {step}: release {zero}")
            elif op == 3:
                pick = [b for b in held if shadow[b] == 0][:2]
                alloc.free(pick)
                for b in pick:
                    del shadow[b]
            elif op == 4 and held and shadow[held[0]] > 0:
                b = held[0]
                new, src = alloc.make_writable(b)
                if src is not None:
                    shadow[b] -= 1
                    shadow[new] = 1
        except OutOfBlocksError:
            short = k > free_before if op == 0 else free_before == 0
            expect(short, f"step {step}: OutOfBlocksError with {free_before} free blocks")
        expect(alloc.num_free == n - len(shadow), f"step {step}: num_free {alloc.num_free}")
        counts = _counts(alloc)
        expect(
            all(counts[b] == shadow.get(b, 0) for b in range(n)),
            f"step {step}: counts {counts} != shadow {shadow}",
        )
