"""Stateful property tests: random allocate / append / match / fork / truncate / free /
evict sequences against the exact-LRU model, with every TESTING.md section 1 invariant
checked after every step (a failing seed reproduces the failure)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_kit.cache import BlockKVCacheManager, FreeListBlockAllocator
from deepinfer_kit.cache.hash_chain_index import HashChainPrefixIndex
from deepinfer_kit.cache.radix_index import RadixPrefixIndex
from deepinfer_kit.cache.protocols import PrefixIndex
from deepinfer_kit.request import Request
from deepinfer_kit.testing.cache_manager_checks import ManagerShadowDriver

INDEXES = {"hash": HashChainPrefixIndex, "radix": RadixPrefixIndex}


def run_driver(kind: str, seed: int, num_blocks: int, block_size: int, steps: int) -> None:
    index: PrefixIndex = INDEXES[kind](block_size)
    manager = BlockKVCacheManager(FreeListBlockAllocator(num_blocks, block_size), index)
    allocator = manager.allocator

    def invariants(live: list[Request]) -> None:
        # conservation, ref counts == holders, no block twice in a table
        manager.check_integrity(live)
        held = {b for r in live for b in r.block_table}
        cached_unreferenced = [
            b for b in range(num_blocks) if index.contains(b) and allocator.ref_count(b) == 0
        ]
        assert len(cached_unreferenced) == index.num_evictable
        assert not held & set(cached_unreferenced)

    driver = ManagerShadowDriver(manager, seed, after_op=invariants)
    for _ in range(steps):
        driver.step()
    driver.drain()
    manager.check_integrity([])  # idle: every count 0, free + evictable == total


@pytest.mark.parametrize("kind", sorted(INDEXES))
@pytest.mark.parametrize(
    ("seed", "num_blocks", "block_size"),
    [(0, 12, 4), (1, 6, 4), (2, 20, 1), (3, 16, 3), (4, 40, 2), (5, 9, 5)],
)
def test_random_operations_keep_invariants(kind: str, seed: int, num_blocks: int, block_size: int) -> None:
    run_driver(kind, seed, num_blocks, block_size, steps=300)


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(sorted(INDEXES)),
    seed=st.integers(0, 2**32 - 1),
    num_blocks=st.integers(3, 24),
    block_size=st.integers(1, 6),
)
def test_random_operations_hypothesis(kind: str, seed: int, num_blocks: int, block_size: int) -> None:
    run_driver(kind, seed, num_blocks, block_size, steps=120)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(INDEXES))
def test_long_random_runs(kind: str) -> None:
    for seed in range(100, 120):
        run_driver(kind, seed, 16, 4, steps=2000)
