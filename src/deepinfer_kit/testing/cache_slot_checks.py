"""The KVCacheManager conformance checks of the one-call APIs: ``allocate_slots`` (the
function over any manager, and a manager's own method when it has one) and
``allocate_next_blocks`` (one round's decode blocks in one call)."""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import partial

from deepinfer_kit.cache.protocols import KVCacheManager
from deepinfer_kit.cache.records import SlotGrant
from deepinfer_kit.cache.slots import allocate_slots
from deepinfer_kit.errors import OutOfBlocksError
from deepinfer_kit.request import Request
from deepinfer_kit.testing.cache_manager_checks import make_request
from deepinfer_kit.testing.suite import ConformanceError, Suite, expect

__all__ = ["allocate_one_by_one", "next_blocks_world", "register_slot_checks"]

P = 4
ManagerFactory = Callable[[int, int], KVCacheManager]


def _expect_refused(call: Callable[[], object], what: str) -> None:
    try:
        call()
    except OutOfBlocksError:
        return
    raise ConformanceError(f"{what} must raise OutOfBlocksError")


def register_slot_checks(suite: Suite[ManagerFactory]) -> None:
    """Add the ``allocate_slots`` checks to ``suite`` (the KVCacheManager suite)."""

    @suite.check
    def check_a_refused_allocate_slots_changes_nothing(factory: ManagerFactory) -> None:
        for own in (False, True):
            m = factory(4, P)
            call = getattr(m, "allocate_slots", None) if own else partial(allocate_slots, m)
            if not callable(call):
                continue
            warm = make_request("warm", list(range(2 * P + 1)))
            m.allocate(warm, warm.num_tokens)
            warm.num_computed_tokens = warm.num_tokens
            m.cache_full_blocks(warm, warm.num_tokens)
            m.free(warm)  # two cached blocks, evictable
            big = make_request("big", list(range(5 * P)))  # shares them, needs 5 blocks
            before = (m.num_free_blocks, big.num_computed_tokens, list(big.block_table))
            _expect_refused(lambda: call(big, big.num_tokens, 0), "allocate_slots beyond the pool")
            after = (m.num_free_blocks, big.num_computed_tokens, list(big.block_table))
            expect(after == before, f"a refused allocate_slots changed {before} to {after}")
            small = make_request("small", list(range(2 * P + 1)))
            grant = call(small, small.num_tokens, 0)
            expect(grant.num_cached_tokens == 2 * P, "the cached blocks survived the refusal")
            # A request holding blocks whose next chunk does not fit: its committed full
            # blocks must not be published by the refused call.
            small.all_token_ids.extend(range(100, 100 + 3 + 2 * P))  # 3 P + 2 P tokens
            computed = 3 * P  # committed: 3 full blocks, the third not published yet
            state = (m.num_free_blocks, small.num_computed_tokens, list(small.block_table))
            _expect_refused(lambda: call(small, 2 * P, computed), "a chunk beyond the pool")  # 1 free
            got = (m.num_free_blocks, small.num_computed_tokens, list(small.block_table))
            expect(got == state, f"a refused allocate_slots changed {state} to {got}")
            probe = make_request("probe", list(small.all_token_ids))
            expect(m.match_prefix(probe) == 2 * P,
                   f"a refused allocate_slots published blocks: {m.match_prefix(probe)} cached")
            m.free(small)

    @suite.check
    def check_allocate_next_blocks_equals_one_allocate_per_request(factory: ManagerFactory) -> None:
        _check_next_blocks(factory)

    @suite.check
    def check_allocate_slots_equals_the_step_by_step_calls(factory: ManagerFactory) -> None:
        for seed in range(3):
            want = _drive_slots(factory(24, P), seed, None)
            m = factory(24, P)
            ways = [("allocate_slots(manager, ...)", m, partial(allocate_slots, m))]
            m = factory(24, P)
            own = getattr(m, "allocate_slots", None)
            if callable(own):  # the manager's own method (e.g. a fast path) must agree too
                ways.append(("manager.allocate_slots(...)", m, own))
            for name, manager, call in ways:
                got = _drive_slots(manager, seed, call)
                expect(got == want, f"seed {seed}: {name} diverged from the step-by-step calls\n"
                                    f"one call:     {got[:6]}\nstep by step: {want[:6]}")


def next_blocks_world(factory: ManagerFactory, seed: int) -> tuple[KVCacheManager, list[Request]]:
    """A small pool after random traffic: finished requests left cached blocks behind
    (evictable, in some LRU order); live ones sit at a block boundary, their next token
    opening a new block."""
    rng = random.Random(seed)
    m = factory(24, P)
    live: list[Request] = []
    for i in range(12):
        n = P * rng.randint(1, 3)
        req = make_request(f"r{i}", [rng.randrange(1, 6) for _ in range(n)])
        cached = m.match_prefix(req)
        if not m.can_allocate(req, n - cached, cached):
            continue
        m.allocate(req, n - cached, cached)
        req.num_computed_tokens = n
        m.cache_full_blocks(req, n)
        req.append_token(rng.randrange(1, 6))
        if rng.random() < 0.5:
            m.free(req)  # its blocks stay cached, evictable
        else:
            live.append(req)
    return m, live


def allocate_one_by_one(manager: KVCacheManager, requests: list[Request]) -> int:
    """What :meth:`KVCacheManager.allocate_next_blocks` stands for: one
    ``allocate(request, 1)`` per request, in order, while ``can_allocate`` holds; returns
    how many got a block. Mutates ``manager`` and the requests' tables."""
    taken = 0
    for req in requests:
        if not manager.can_allocate(req, 1):
            break
        manager.allocate(req, 1)
        taken += 1
    return taken


def _check_next_blocks(factory: ManagerFactory) -> None:
    """``allocate_next_blocks`` equals one ``allocate(request, 1)`` per request in order
    while ``can_allocate`` holds: the count served, the tables, the free count, and the
    blocks a later allocation takes (the eviction order left behind)."""
    for seed in range(6):
        bulk, reqs_a = next_blocks_world(factory, seed)
        step, reqs_b = next_blocks_world(factory, seed)
        got = bulk.allocate_next_blocks(reqs_a)
        taken = allocate_one_by_one(step, reqs_b)
        expect(got == taken, f"seed {seed}: allocate_next_blocks served {got} requests, one "
                             f"allocate per request {taken}")
        tables_a, tables_b = [r.block_table for r in reqs_a], [r.block_table for r in reqs_b]
        expect(tables_a == tables_b, f"seed {seed}: tables {tables_a} != {tables_b}")
        expect(bulk.num_free_blocks == step.num_free_blocks,
               f"seed {seed}: {bulk.num_free_blocks} free blocks != {step.num_free_blocks}")
        later = [make_request("later", list(range(100, 100 + P * bulk.num_free_blocks)))
                 for _ in range(2)]
        for m, r in zip((bulk, step), later):
            if r.num_tokens and m.can_allocate(r, r.num_tokens):
                m.allocate(r, r.num_tokens)
        expect(later[0].block_table == later[1].block_table,
               f"seed {seed}: the blocks evicted next differ: {later[0].block_table} != "
               f"{later[1].block_table}")


def _drive_slots(
    m: KVCacheManager, seed: int, one_call: Callable[[Request, int], SlotGrant] | None
) -> list[tuple[object, ...]]:
    """Chunked prefills and decodes of requests sharing prefixes, scheduled either through
    ``one_call(request, num_new_tokens)`` (an ``allocate_slots`` of ``m``) or, when it is
    None, through ``cache_full_blocks`` / ``match_prefix`` / ``allocate``; returns what
    each step saw (hits, tables, free blocks)."""
    rng = random.Random(seed)
    heads = [[rng.randrange(40) for _ in range(rng.randrange(2 * P, 4 * P))] for _ in range(3)]
    live: list[Request] = []
    seen: list[tuple[object, ...]] = []
    for i in range(60):
        if len(live) < 3 and rng.random() < 0.6:
            tail = [rng.randrange(40) for _ in range(rng.randrange(1, P + 2))]
            live.append(make_request(f"r{i}", rng.choice(heads) + tail))
        if not live:
            continue
        r = rng.choice(live)
        if r.num_computed_tokens == r.num_tokens:  # the last step committed: a token arrives
            if r.num_tokens > 5 * P or rng.random() < 0.3:
                if one_call is not None:
                    one_call(r, 0)  # publishes what the last step wrote
                else:
                    m.cache_full_blocks(r, r.num_tokens)
                m.free(r)
                live.remove(r)
                seen.append(("free", r.request_id, m.num_free_blocks))
                continue
            r.append_token(rng.randrange(40))
        end = r.num_tokens if rng.random() < 0.5 else rng.randint(r.num_computed_tokens + 1, r.num_tokens)
        if one_call is not None:
            grant = one_call(r, end - r.num_computed_tokens)
            cached, start = grant.num_cached_tokens, grant.num_computed_tokens
        else:
            cached = 0
            if r.block_table:
                m.cache_full_blocks(r, r.num_computed_tokens)
            else:
                cached = min(m.match_prefix(r), (end - 1) // P * P)
                r.num_computed_tokens = cached
            m.allocate(r, end - r.num_computed_tokens, cached)
            start = r.num_computed_tokens
        seen.append((r.request_id, cached, start, list(r.block_table), m.num_free_blocks))
        r.num_computed_tokens = end  # the step ran and committed
    for r in live:
        m.free(r)
    m.check_integrity(())
    return seen
