"""The PrefixIndex conformance checks (registered on ``PREFIX_INDEX_SUITE`` and on the suite
:func:`~deepinfer_kit.testing.cache.prefix_index_suite` makes for another eviction order).

The eviction order is the reference policy's: every check that evicts drives a fresh
reference (an :class:`EvictionPolicy`, exact LRU by default) with the calls the index
should make to its own policy — ``push`` when blocks become unreferenced, ``discard``
when they are referenced again, ``touch`` on the hits of a match (tail first), ``pop``
on eviction — and expects the index to evict what the reference pops."""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable

from deepinfer_kit.cache.protocols import EvictionPolicy, PrefixIndex
from deepinfer_kit.testing.suite import Suite, expect

__all__ = ["register_index_checks"]

P = 4
IndexFactory = Callable[[int], PrefixIndex]
Reference = Callable[[], EvictionPolicy]


def _tokens(seed: int, n: int, vocab: int = 50) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def _chains(index: PrefixIndex) -> tuple[list[int], list[int], list[int], list[int]]:
    """Publish chain A (3 blocks, ids 0-2) and chain B (2 blocks, ids 10-11); both in use."""
    a, b = _tokens(1, 3 * P), _tokens(2, 2 * P)
    index.insert(a, [0, 1, 2])
    index.insert(b, [10, 11])
    return a, [0, 1, 2], b, [10, 11]


def _check_insert_then_match_full_blocks(factory: IndexFactory) -> None:
    index = factory(P)
    t = _tokens(0, 3 * P + 2)
    expect(index.insert(t, [5, 6, 7]) == [5, 6, 7], "insert returns the blocks it recorded")
    expect(index.match(t) == [5, 6, 7], "the full blocks of the inserted tokens must match")
    expect(index.match(t[: 2 * P + 3]) == [5, 6], "only whole blocks of the query match")
    expect(index.match(t, max_blocks=1) == [5], "max_blocks caps the match")
    other = list(t)
    other[P + 1] += 1
    expect(index.match(other) == [5], "a different token in block 1 stops the match there")
    other[0] += 1
    expect(index.match(other) == [], "a different first block matches nothing")
    expect(all(index.contains(b) for b in (5, 6, 7)), "inserted blocks are cached")
    expect(index.num_evictable == 0 and index.evict(3) == [], "inserted blocks are in use")


def _check_context_separates_equal_tokens(factory: IndexFactory) -> None:
    index = factory(P)
    t = _tokens(3, 2 * P)
    contexts: list[Hashable] = [None, "salt-a", ("lora", 1), ("lora", 2), 0, b"mm"]
    for i, ctx in enumerate(contexts):
        index.insert(t, [2 * i, 2 * i + 1], context=ctx)
    for i, ctx in enumerate(contexts):
        got = index.match(t, context=ctx)
        expect(got == [2 * i, 2 * i + 1], f"context {ctx!r} must match its own blocks, got {got}")
    expect(index.match(t, context="salt-b") == [], "an unseen context must miss")


def _check_duplicates_and_published_blocks_not_taken(factory: IndexFactory) -> None:
    index = factory(P)
    t, u = _tokens(4, 2 * P), _tokens(5, 2 * P)
    index.insert(t, [1, 2])
    expect(index.insert(t, [3, 4]) == [], "content already cached must not be taken again")
    expect(index.match(t) == [1, 2], "the first publisher keeps the identity")
    expect(not index.contains(3), "a duplicate block is not cached")
    expect(index.insert(u, [1, 9]) == [9], "a block already published is not rebound")
    expect(index.match(u) == [], "block 0 of u was not published under u's identity")
    expect(index.match(t, memo=[]) == [1, 2], "a rejected rebind leaves the old identity")


def _check_mark_unused_returns_uncached_blocks(factory: IndexFactory) -> None:
    index = factory(P)
    _chains(index)
    rest = index.mark_unused([2, 99, 1, 98])
    expect(rest == [99, 98], f"mark_unused returns the uncached blocks in order, got {rest}")
    expect(index.num_evictable == 2, f"two cached blocks became evictable, got {index.num_evictable}")
    index.mark_used([1, 97])
    expect(index.num_evictable == 1, "mark_used takes blocks out of the evictable set")
    expect(index.evict(5) == [2], "only unreferenced cached blocks are evicted")


def _check_eviction_follows_the_reference_tail_first(factory: IndexFactory, reference: Reference) -> None:
    index, ref = factory(P), reference()
    a, ablocks, b, bblocks = _chains(index)
    for blocks in (ablocks[::-1], bblocks[::-1]):
        index.mark_unused(blocks)
        ref.push(blocks)
    want = ref.pop(1)
    expect(index.evict(1) == want, f"the first victim must be the reference's {want}")
    want += ref.pop(10)
    got = want[:1] + index.evict(10)
    expect(got == want, f"eviction order must be the reference's {want}; got {got}")
    expect(index.stats.evicted_blocks == 5, f"evicted counter: {index.stats.evicted_blocks}")


def _check_match_touches_the_hits(factory: IndexFactory, reference: Reference) -> None:
    index, ref = factory(P), reference()
    a, ablocks, b, bblocks = _chains(index)
    for blocks in (ablocks[::-1], bblocks[::-1]):
        index.mark_unused(blocks)
        ref.push(blocks)
    expect(index.match(a[: 2 * P]) == [0, 1], "chain A's head matches")
    ref.touch([1, 0])
    order, want = index.evict(10), ref.pop(10)
    expect(order == want, f"a match touches its hits, tail first: reference order {want}, got {order}")


def _check_evicted_block_loses_identity(factory: IndexFactory) -> None:
    index = factory(P)
    a, ablocks, b, _ = _chains(index)
    index.mark_unused([2])  # the only evictable block, whatever the policy
    expect(index.evict(1) == [2], "the tail of A is evicted")
    expect(not index.contains(2), "an evicted block holds no identity")
    expect(index.match(a) == [0, 1], "a match stops at the evicted block")
    c = _tokens(6, P)
    index.insert(c, [2])
    expect(index.match(c) == [2], "a reused block gets its new identity")
    expect(index.match(a) == [0, 1], "a reused block never answers for its old content")


def _check_touch_false_changes_nothing(factory: IndexFactory, reference: Reference) -> None:
    index, ref = factory(P), reference()
    a, ablocks, b, bblocks = _chains(index)
    for blocks in (ablocks[::-1], bblocks[::-1]):
        index.mark_unused(blocks)
        ref.push(blocks)
    before = (index.stats.queries, index.stats.query_blocks, index.stats.hit_blocks)
    expect(index.match(a, touch=False) == ablocks, "a lookup still finds the blocks")
    after = (index.stats.queries, index.stats.query_blocks, index.stats.hit_blocks)
    expect(after == before, f"touch=False must not count, {before} -> {after}")
    expect(index.evict(10) == ref.pop(10), "touch=False must not touch the policy")


def _check_stats_count_queries_and_hits(factory: IndexFactory) -> None:
    index = factory(P)
    a, _, b, _ = _chains(index)
    index.match(a)
    index.match(a[:P] + _tokens(7, 2 * P))
    stats = index.stats
    got = (stats.queries, stats.query_blocks, stats.hit_blocks, stats.inserted_blocks)
    expect(got == (2, 6, 4, 5), f"(queries, query_blocks, hit_blocks, inserted) = {got}")
    expect(abs(stats.hit_rate - 4 / 6) < 1e-9, f"hit_rate {stats.hit_rate}")


def _check_memo_and_start_are_transparent(factory: IndexFactory) -> None:
    index = factory(P)
    t = _tokens(8, 5 * P)
    memo: list[bytes] = []
    expect(index.match(t[: 2 * P], memo=memo) == [], "empty index")
    index.insert(t[: 2 * P], [0, 1], memo=memo)
    index.insert(t[: 4 * P], [0, 1, 2, 3], memo=memo, start=2)
    expect(index.match(t, memo=memo) == [0, 1, 2, 3], "memo'd keys must equal fresh ones")
    expect(index.match(t) == [0, 1, 2, 3], "a fresh match finds what memo'd inserts stored")
    expect(index.insert(t, [0, 1, 2, 3, 4], start=5) == [], "start beyond blocks inserts nothing")


def _check_random_operations_against_shadow(factory: IndexFactory, reference: Reference) -> None:
    """Random insert / match / mark / evict against an exact content-keyed shadow whose
    eviction order is the reference policy's."""
    rng = random.Random(99)
    index, ref = factory(P), reference()
    common = _tokens(10, 2 * P, vocab=3)
    bases = [common + _tokens(11 + i, 4 * P, vocab=3) for i in range(3)] + [_tokens(20, 6 * P, 3)]
    contexts: list[Hashable] = [None, "s"]
    content: dict[tuple[Hashable, tuple[int, ...]], int] = {}
    owner: dict[int, tuple[Hashable, tuple[int, ...]]] = {}
    evictable: set[int] = set()
    free_ids = list(range(64))
    for step in range(700):
        op = rng.randrange(5)
        ctx = rng.choice(contexts)
        toks = rng.choice(bases)[: rng.randint(0, 6) * P + rng.randrange(P)]
        keys = [(ctx, tuple(toks[: (i + 1) * P])) for i in range(len(toks) // P)]
        if op == 0 and len(free_ids) >= len(keys):
            blocks = [free_ids.pop(rng.randrange(len(free_ids))) for _ in keys]
            expect_new = [b for k, b in zip(keys, blocks) if k not in content]
            for k, b in zip(keys, blocks):
                if k not in content:
                    content[k], owner[b] = b, k
            got = index.insert(toks, blocks, context=ctx)
            expect(got == expect_new, f"step {step}: insert recorded {got}, expected {expect_new}")
            free_ids += [b for b in blocks if b not in owner]
        elif op == 1:
            want: list[int] = []
            for k in keys:
                if k not in content:
                    break
                want.append(content[k])
            got = index.match(toks, context=ctx)
            expect(got == want, f"step {step}: match {got}, shadow {want}")
            if want:
                ref.touch(want[::-1])
        elif op == 2:
            used = [b for b in owner if b not in evictable]
            pick = rng.sample(used, min(len(used), rng.randint(1, 3)))
            expect(index.mark_unused(pick) == [], f"step {step}: cached blocks reported uncached")
            ref.push(pick)
            evictable.update(pick)
        elif op == 3 and evictable:
            pick = rng.sample(sorted(evictable), min(len(evictable), 2))
            index.mark_used(pick)
            ref.discard(pick)
            evictable.difference_update(pick)
        elif op == 4:
            count = rng.randint(1, 3)
            got, want = index.evict(count), ref.pop(count)
            expect(got == want, f"step {step}: evicted {got}, the reference pops {want}")
            for b in got:
                del content[owner.pop(b)]
            evictable.difference_update(got)
            free_ids += got
        expect(index.num_evictable == len(evictable), f"step {step}: num_evictable {index.num_evictable}")
        expect(all(index.contains(b) == (b in owner) for b in range(64)), f"step {step}: contains")


def register_index_checks(suite: Suite[IndexFactory], reference: Reference) -> None:
    """Add every PrefixIndex check to ``suite``, the eviction order checked against policies
    ``reference()`` builds (called once per suite by testing.cache)."""

    @suite.check
    def check_empty_index_misses(factory: IndexFactory) -> None:
        index = factory(4)
        expect(index.match(list(range(16))) == [], "an empty index must match nothing")
        expect(index.num_evictable == 0, "an empty index has nothing to evict")
        expect(index.evict(3) == [], "evict on an empty index must return []")

    for fn in (
        _check_insert_then_match_full_blocks,
        _check_context_separates_equal_tokens,
        _check_duplicates_and_published_blocks_not_taken,
        _check_mark_unused_returns_uncached_blocks,
        _check_evicted_block_loses_identity,
        _check_stats_count_queries_and_hits,
        _check_memo_and_start_are_transparent,
    ):
        fn.__name__ = fn.__name__.lstrip("_")
        suite.check(fn)
    for ordered in (
        _check_eviction_follows_the_reference_tail_first,
        _check_match_touches_the_hits,
        _check_touch_false_changes_nothing,
        _check_random_operations_against_shadow,
    ):
        def check(factory: IndexFactory, _fn: Callable[[IndexFactory, Reference], None] = ordered) -> None:
            _fn(factory, reference)

        check.__name__ = ordered.__name__.lstrip("_")
        suite.check(check)
