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


# An index and a manager that evict in another order pass the suites built with that order as
# the reference, and fail the exact-LRU ones.
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from own_components import MRUEvictionPolicy  # noqa: E402

from deepinfer_kit.testing.cache import kv_cache_manager_suite, prefix_index_suite  # noqa: E402
from deepinfer_kit.testing.eviction import EVICTION_POLICY_SUITE  # noqa: E402
from deepinfer_kit.testing.suite import ConformanceError  # noqa: E402

MRU_INDEX_SUITE = prefix_index_suite(MRUEvictionPolicy)
MRU_MANAGER_SUITE = kv_cache_manager_suite(MRUEvictionPolicy)


def _mru_index(kind: str) -> object:
    return lambda block_size: INDEXES[kind](block_size, policy=MRUEvictionPolicy())


def _mru_manager(kind: str) -> object:
    return lambda num_blocks, block_size: BlockKVCacheManager(
        FreeListBlockAllocator(num_blocks, block_size), INDEXES[kind](block_size, policy=MRUEvictionPolicy()))


@pytest.mark.parametrize("check", EVICTION_POLICY_SUITE.checks, ids=EVICTION_POLICY_SUITE.ids)
def test_the_mru_policy_keeps_the_policy_contract(check: Check[object]) -> None:
    check(MRUEvictionPolicy)


@pytest.mark.parametrize("kind", sorted(INDEXES))
@pytest.mark.parametrize("check", MRU_INDEX_SUITE.checks, ids=MRU_INDEX_SUITE.ids)
def test_an_mru_index_passes_the_index_suite_of_its_order(check: Check[object], kind: str) -> None:
    check(_mru_index(kind))


@pytest.mark.parametrize("kind", sorted(INDEXES))
@pytest.mark.parametrize("check", MRU_MANAGER_SUITE.checks, ids=MRU_MANAGER_SUITE.ids)
def test_an_mru_manager_passes_the_manager_suite_of_its_order(check: Check[object], kind: str) -> None:
    check(_mru_manager(kind))


@pytest.mark.parametrize(("suite", "factory"), [(PREFIX_INDEX_SUITE, _mru_index("radix")),
                                                (KV_CACHE_MANAGER_SUITE, _mru_manager("radix")),
                                                (MRU_INDEX_SUITE, lambda P: RadixPrefixIndex(P))])
def test_an_index_fails_the_suite_of_another_order(suite: object, factory: object) -> None:
    with pytest.raises(ConformanceError, match="order|evict|reference"):
        suite.run(factory)  # type: ignore[attr-defined]
