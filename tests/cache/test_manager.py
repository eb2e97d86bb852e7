"""BlockKVCacheManager: prefix hits, allocation, forks with copy-on-write, free, publish."""

from __future__ import annotations

import pytest

from deepinfer_kit.cache import BlockKVCacheManager, CacheConfig
from deepinfer_kit.errors import ConfigError, InvariantError, OutOfBlocksError
from deepinfer_kit.testing.cache_manager_checks import admit
from deepinfer_kit.testing.cache_manager_checks import make_request as req

P = 4
KINDS = ["hash", "radix"]


def make(kind: str, num_blocks: int = 16, caching: bool = True) -> BlockKVCacheManager:
    config = CacheConfig(block_size=P, num_blocks=num_blocks, enable_prefix_caching=caching)
    return BlockKVCacheManager.create(config, kind)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_hit_reuses_blocks_and_leaves_one_token(kind: str) -> None:
    m = make(kind)
    a = req("a", list(range(12)))
    assert admit(m, a) == 0
    b = req("b", list(range(12)))
    assert m.match_prefix(b) == 8  # a full-prompt hit still computes the last block
    m.allocate(b, 4, 8)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    m.check_integrity([a, b])
    m.free(a)
    m.free(b)
    m.check_integrity([])


@pytest.mark.parametrize("kind", KINDS)
def test_fork_copies_partial_block_on_write(kind: str) -> None:
    m = make(kind)
    parent = req("p", list(range(10)))
    admit(m, parent)
    child = req("p#1", list(range(10)))
    m.fork(parent, child)
    child.num_computed_tokens = 10
    assert child.block_table == parent.block_table
    copies = m.allocate(child, 1)
    assert copies == [(parent.block_table[2], child.block_table[2])]
    assert child.block_table[:2] == parent.block_table[:2]
    assert m.allocate(parent, 1) == []  # the parent now holds its block alone
    m.check_integrity([parent, child])
    m.free(parent)
    m.free(child)
    m.check_integrity([])


@pytest.mark.parametrize("kind", KINDS)
def test_failed_allocation_changes_nothing(kind: str) -> None:
    m = make(kind, num_blocks=4)
    a = req("a", list(range(12)))
    admit(m, a)
    b = req("b", list(range(100, 112)))
    before = (m.num_free_blocks, list(a.block_table))
    assert not m.can_allocate(b, 12)
    with pytest.raises(OutOfBlocksError):
        m.allocate(b, 12)
    assert (m.num_free_blocks, a.block_table, b.block_table) == (*before, [])
    m.check_integrity([a, b])


def test_prefix_caching_off_never_hits() -> None:
    m = make("hash", caching=False)
    a = req("a", list(range(12)))
    admit(m, a)
    m.free(a)
    assert m.match_prefix(req("b", list(range(12)))) == 0
    assert m.num_free_blocks == 16
    m.check_integrity([])


def test_stale_cached_count_is_rejected() -> None:
    m = make("hash", num_blocks=4)
    a = req("a", list(range(12)))
    admit(m, a)
    m.free(a)
    b = req("b", list(range(12)))
    cached = m.match_prefix(b)
    assert cached == 8
    other = req("c", list(range(200, 216)))
    m.allocate(other, 16)  # evicts a's cached blocks
    with pytest.raises(InvariantError):
        m.allocate(b, 4, cached)
    assert b.block_table == []


def test_create_rejects_unknown_index() -> None:
    with pytest.raises(ConfigError, match="index"):
        BlockKVCacheManager.create(CacheConfig(), "lru")  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", KINDS)
def test_rewrite_after_truncate_into_published_block_copies(kind: str) -> None:
    m = make(kind)
    a = req("a", list(range(12)))
    admit(m, a)  # blocks 0-2 published
    published = list(a.block_table)
    m.truncate(a, 6)  # roll back into block 1, which the cache publishes
    a.num_computed_tokens = 6
    copies = m.allocate(a, 2)
    assert copies == [(published[1], a.block_table[1])]
    assert a.block_table[0] == published[0] and a.block_table[1] != published[1]
    b = req("b", list(range(12)) + [5])
    assert m.match_prefix(b) == 12  # the published blocks keep their content
    m.allocate(b, 1, 12)
    assert b.block_table[:3] == published
    m.check_integrity([a, b])


@pytest.mark.parametrize("kind", KINDS)
def test_taking_evictable_cached_blocks_counts_against_the_pool(kind: str) -> None:
    m = make(kind, num_blocks=4)
    a = req("a", list(range(12)))
    admit(m, a)
    m.free(a)  # 3 evictable cached blocks + 1 free
    b = req("b", list(range(12)) + list(range(100, 104)))
    cached = m.match_prefix(b)
    assert cached == 12
    assert m.num_free_blocks == 4
    assert m.can_allocate(b, 4, cached)  # 3 cached taken, 1 new: fits exactly
    assert not m.can_allocate(b, 5, cached)  # 2 new blocks would need an evicted hit
    with pytest.raises(OutOfBlocksError):
        m.allocate(b, 5, cached)
    m.allocate(b, 4, cached)
    assert m.num_free_blocks == 0
    m.check_integrity([b])


def test_mismatched_block_sizes_are_rejected() -> None:
    from deepinfer_kit.cache import FreeListBlockAllocator, HashChainPrefixIndex

    with pytest.raises(ConfigError, match="block_size"):
        BlockKVCacheManager(FreeListBlockAllocator(8, 4), HashChainPrefixIndex(8))


def test_usage_and_stats() -> None:
    m = make("hash")
    assert m.usage == 0.0 and m.stats is not None
    a = req("a", list(range(8)))
    admit(m, a)
    assert m.usage == 2 / 16
    admit(m, req("b", list(range(9))))
    assert (m.stats.queries, m.stats.hit_blocks) == (2, 2)
    assert make("hash", caching=False).stats is None


@pytest.mark.parametrize("kind", KINDS)
def test_negative_counts_are_caller_bugs(kind: str) -> None:
    m = make(kind)
    a = req("a", list(range(8)))
    with pytest.raises(InvariantError):
        m.allocate(a, -1)
    with pytest.raises(InvariantError):
        m.truncate(a, -1)
    other = req("o", [1])
    m.allocate(other, 1)
    with pytest.raises(InvariantError):
        m.fork(a, other)  # the child already holds blocks
