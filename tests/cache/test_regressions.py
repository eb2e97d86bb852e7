"""Regressions from other engines' bug trackers (TESTING.md section 3, items 1-8 and 22)."""

from __future__ import annotations

import random

import pytest

from deepinfer_kit.cache import (
    BlockKVCacheManager,
    CacheConfig,
    FreeListBlockAllocator,
    HashChainPrefixIndex,
    RadixPrefixIndex,
)
from deepinfer_kit.cache.hashing import BlockHasher
from deepinfer_kit.errors import InvariantError
from deepinfer_kit.testing.cache_manager_checks import admit
from deepinfer_kit.testing.cache_manager_checks import make_request as req

P = 4
KINDS = ["hash", "radix"]


def make(kind: str, num_blocks: int = 16) -> BlockKVCacheManager:
    return BlockKVCacheManager.create(CacheConfig(block_size=P, num_blocks=num_blocks), kind)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", KINDS)
def test_01_blocks_not_readable_before_their_step_commits(kind: str) -> None:
    m = make(kind)
    a, b = req("a", list(range(12))), req("b", list(range(12)) + [1])
    m.allocate(a, 12)  # scheduled in this step, KV not written yet
    assert m.match_prefix(b) == 0  # a request in the same step must not read them
    a.num_computed_tokens = 12
    m.cache_full_blocks(a, 12)  # the step committed
    assert m.match_prefix(b) == 12


def test_02_a_block_never_enters_the_free_list_twice() -> None:
    alloc = FreeListBlockAllocator(4, P)
    (b,) = alloc.allocate(1)
    assert alloc.release([b]) == [b]
    alloc.free([b])
    with pytest.raises(InvariantError):
        alloc.free([b])
    with pytest.raises(InvariantError):
        alloc.release([b])
    assert alloc.ref_count(b) == 0
    assert sorted(alloc.allocate(4)) == [0, 1, 2, 3]  # each block exactly once


@pytest.mark.parametrize("kind", KINDS)
def test_02_double_free_of_a_request_is_harmless(kind: str) -> None:
    m = make(kind)
    a = req("a", list(range(10)))
    admit(m, a)
    m.free(a)
    m.free(a)
    m.check_integrity([])
    assert m.num_free_blocks == 16


@pytest.mark.parametrize("kind", KINDS)
def test_03_stale_cached_count_from_a_failed_attempt_is_rejected(kind: str) -> None:
    m = make(kind, num_blocks=4)
    first = req("a", list(range(12)))
    admit(m, first)
    m.free(first)
    b = req("b", list(range(12)))
    cached = m.match_prefix(b)  # attempt 1 ...
    assert cached == 8
    other = req("c", list(range(100, 116)))
    m.allocate(other, 16)  # ... fails to schedule b; meanwhile the cache changed
    with pytest.raises(InvariantError, match="match_prefix again"):
        m.allocate(b, 4, cached)
    assert b.block_table == [] and m.num_free_blocks == 0
    m.free(other)
    assert m.match_prefix(b) == 0  # attempt 2 recomputes from the current cache
    m.check_integrity([])


def test_04_a_hash_hit_with_other_tokens_is_never_returned() -> None:
    key = b"fixed-key-for-a-reproducible-collision"
    hasher = BlockHasher(key, digest_size=1)
    rng = random.Random(4)
    a = [rng.randrange(1000) for _ in range(P)]
    root = hasher.root(None)
    keys: list[bytes] = []
    hasher.extend_chain(keys, a, 1, P, root)
    while True:  # find a first block whose 1-byte key collides with a's
        b = [rng.randrange(1000) for _ in range(P)]
        other: list[bytes] = []
        hasher.extend_chain(other, b, 1, P, root)
        if other == keys and b != a:
            break
    index = HashChainPrefixIndex(P, key=key, digest_size=1)
    index.insert(a, [7])
    assert index.match(a) == [7]
    assert index.match(b) == []  # same key, other tokens: a miss, never block 7


@pytest.mark.parametrize("index_cls", [HashChainPrefixIndex, RadixPrefixIndex])
def test_04_collisions_everywhere_never_return_wrong_blocks(index_cls: type) -> None:
    rng = random.Random(5)
    # 256 chain keys: collisions on nearly every insert (the radix compares exact bytes)
    index = index_cls(P, digest_size=1) if index_cls is HashChainPrefixIndex else index_cls(P)
    content: dict[int, tuple[int, ...]] = {}
    seqs = [[rng.randrange(3) for _ in range(6 * P)] for _ in range(60)]
    next_block = 0
    for s in seqs:
        blocks = list(range(next_block, next_block + 6))
        next_block += 6
        for b in index.insert(s, blocks):
            content[b] = tuple(s[: (blocks.index(b) + 1) * P])
    for s in seqs + [[rng.randrange(3) for _ in range(6 * P)] for _ in range(200)]:
        for i, b in enumerate(index.match(s)):
            assert content[b] == tuple(s[: (i + 1) * P])


@pytest.mark.parametrize("kind", KINDS)
def test_05_a_prefix_hit_places_new_tokens_after_the_prefix(kind: str) -> None:
    m = make(kind)
    admit(m, req("a", list(range(13))))
    b = req("b", list(range(13)) + [50, 51, 52])
    cached = m.match_prefix(b)
    assert cached == 12
    m.allocate(b, b.num_tokens - cached, cached)
    slots = [b.block_table[t // P] * P + t % P for t in range(b.num_tokens)]
    prefix_blocks = set(b.block_table[:3])
    # new positions 12.. land in a private block, never at the start of a cached one
    assert all(s // P not in prefix_blocks for s in slots[12:])
    assert len(set(slots)) == len(slots)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_outputs", [3, 4, 5])  # total 12, 13 and 14 tokens around a boundary
def test_06_07_preempted_request_rematches_with_its_outputs(kind: str, num_outputs: int) -> None:
    m = make(kind)
    r = req("a", list(range(9)))
    admit(m, r)
    for i in range(num_outputs):
        r.append_token(100 + i)
        m.allocate(r, 1)
        r.num_computed_tokens += 1
        m.cache_full_blocks(r, r.num_computed_tokens)
    r.append_token(99)  # sampled, not yet computed
    m.free(r)  # preemption by recompute
    r.num_computed_tokens = 0
    cached = m.match_prefix(r)
    assert cached % P == 0 and cached <= r.num_tokens - 1
    assert cached == (r.num_tokens - 1) // P * P  # its own outputs were published
    m.allocate(r, r.num_tokens - cached, cached)
    assert len(r.block_table) == -(-r.num_tokens // P)  # covers every token, not one less
    r.num_computed_tokens = r.num_tokens
    r.append_token(7)
    m.allocate(r, 1)
    assert len(r.block_table) == -(-r.num_tokens // P)
    m.check_integrity([r])


@pytest.mark.parametrize("kind", KINDS)
def test_08_free_after_a_prefix_hit_releases_prefix_and_suffix(kind: str) -> None:
    m = make(kind)
    a = req("a", list(range(12)))
    admit(m, a)
    b = req("b", list(range(12)) + [9, 9, 9])
    assert admit(m, b) == 12
    m.free(b)
    m.free(a)
    m.check_integrity([])  # every count is 0: the cache holds the prefix only as evictable
    assert m.num_free_blocks == m.num_blocks


def test_22_hash_keys_are_not_predictable_across_processes() -> None:
    tokens = list(range(P))
    keys = []
    for _ in range(2):  # two default indexes stand for two processes
        k: list[bytes] = []
        index = HashChainPrefixIndex(P)
        index.insert(tokens, [0], memo=k)
        keys.append(k[0])
    assert keys[0] != keys[1]
    fixed = [BlockHasher(b"shared").root(None) for _ in range(2)]
    assert fixed[0] == fixed[1] != BlockHasher(b"other").root(None)
    assert BlockHasher(b"shared").root(None) != BlockHasher(b"shared").root("None")
