"""The KVCacheManager conformance checks, and the random-operation driver that runs a
manager side by side with the exact-LRU model (also used by the project's own tests)."""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable

from deepinfer_kit.cache.protocols import EvictionPolicy, KVCacheManager
from deepinfer_kit.errors import InvariantError, OutOfBlocksError
from deepinfer_kit.request import Request
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.testing.lru_reference import ExactLRUPrefixCache
from deepinfer_kit.testing.suite import Suite, expect

__all__ = ["ManagerShadowDriver", "register_manager_checks", "make_request", "admit"]

P = 4
ManagerFactory = Callable[[int, int], KVCacheManager]
_PARAMS = SamplingParams()


def make_request(rid: str, tokens: list[int], context: Hashable = None) -> Request:
    """A request over ``tokens`` (default sampling parameters) for cache tests."""
    return Request(rid, list(tokens), _PARAMS, cache_context=context)


def admit(m: KVCacheManager, r: Request) -> int:
    """Prefill ``r`` like a scheduler in one step: match, allocate the rest, commit,
    publish. Returns the cached tokens."""
    cached = m.match_prefix(r)
    m.allocate(r, r.num_tokens - cached, cached)
    r.num_computed_tokens = r.num_tokens
    m.cache_full_blocks(r, r.num_tokens)
    return cached


class ManagerShadowDriver:
    """Random scheduler-like operations on a manager and on :class:`ExactLRUPrefixCache`
    in lockstep, checking after every operation that both agree (prefix hits, allocation
    success, copy counts, free blocks, which requests share which blocks).

    Args:
        manager: a fresh manager with prefix caching on, evicting in ``reference``'s order.
        seed: the random seed (a failing seed reproduces the failure).
        after_op: called after every operation with the live requests (for extra
            implementation-specific invariants such as ``check_integrity``).
        reference: builds the model's eviction policy (``None``: exact LRU).
    """

    def __init__(
        self, manager: KVCacheManager, seed: int,
        after_op: Callable[[list[Request]], None] | None = None,
        reference: Callable[[], EvictionPolicy] | None = None,
    ) -> None:
        self.m = manager
        self.model = ExactLRUPrefixCache(manager.num_blocks, manager.block_size,
                                         policy=reference() if reference is not None else None)
        self.rng = random.Random(seed)
        self.after_op = after_op
        self.live: dict[str, Request] = {}
        self.next_id = 0
        P = manager.block_size
        common = [self.rng.randrange(4) for _ in range(2 * P)]
        self.bases = [common + [self.rng.randrange(4) for _ in range(5 * P)] for _ in range(3)]
        self.log: list[str] = []

    def _allocate(self, r: Request, n: int, cached: int = 0) -> bool:
        can = self.m.can_allocate(r, n, cached)
        try:
            copies = self.m.allocate(r, n, cached)
        except OutOfBlocksError:
            copies = None
        want = self.model.allocate(
            r.request_id, r.all_token_ids, r.cache_context, r.num_computed_tokens, n, cached
        )
        got = None if copies is None else len(copies)
        expect(got == want, f"{self.log[-1]}: allocate gave {got} copies, model {want}")
        expect(can == (copies is not None), f"{self.log[-1]}: can_allocate said {can}")
        for src, dst in copies or ():
            expect(dst in r.block_table and src not in r.block_table, f"bad copy {(src, dst)}")
        return copies is not None

    def _commit(self, r: Request, n: int) -> None:
        r.num_computed_tokens += n
        self.m.cache_full_blocks(r, r.num_computed_tokens)
        self.model.publish(r.request_id, r.all_token_ids, r.cache_context, r.num_computed_tokens)

    def step(self) -> None:
        """One random operation, then the agreement checks."""
        rng, m = self.rng, self.m
        op = rng.randrange(6)
        rid = rng.choice(sorted(self.live)) if self.live else None
        r = self.live.get(rid) if rid else None
        if op == 0 or r is None:
            base = rng.choice(self.bases)
            tokens = base[: rng.randint(1, len(base))]
            r = make_request(f"r{self.next_id}", tokens, rng.choice([None, None, "salt"]))
            self.next_id += 1
            self.log.append(f"admit {r.request_id} len={len(tokens)} ctx={r.cache_context}")
            cached = m.match_prefix(r)
            want = self.model.match_prefix(r.all_token_ids, r.cache_context)
            expect(cached == want, f"{self.log[-1]}: match_prefix {cached}, model {want}")
            expect(cached < r.num_tokens, f"{self.log[-1]}: a full-prompt hit must leave a token")
            chunk = rng.randint(1, r.num_tokens - cached)
            if self._allocate(r, chunk, cached):
                self.live[r.request_id] = r
                r.num_computed_tokens = cached
                self._commit(r, chunk)
            else:
                self.model.free(r.request_id)
        elif op == 1:
            prefill = r.num_tokens - r.num_computed_tokens
            if prefill <= 0:
                r.all_token_ids.append(rng.randrange(4))
            n = rng.randint(1, max(1, prefill))
            self.log.append(f"step {rid} n={n}")
            if self._allocate(r, n):
                self._commit(r, n)
        elif op == 2:
            k = rng.randint(1, 3)
            self.log.append(f"speculate {rid} k={k}")
            if r.num_computed_tokens == r.num_tokens and self._allocate(r, k):
                accepted = rng.randint(0, k)
                r.all_token_ids.extend(rng.randrange(4) for _ in range(accepted))
                r.num_computed_tokens += accepted
                m.truncate(r, r.num_computed_tokens)
                self.model.truncate(rid, r.num_computed_tokens)  # type: ignore[arg-type]
                self._commit(r, 0)
        elif op == 3:
            child = make_request(f"{rid}#{self.next_id}", r.all_token_ids, r.cache_context)
            self.next_id += 1
            self.log.append(f"fork {rid} -> {child.request_id}")
            child.num_computed_tokens = r.num_computed_tokens
            m.fork(r, child)
            self.model.fork(r.request_id, child.request_id)
            self.live[child.request_id] = child
        else:
            self.log.append(f"free {rid}")
            m.free(r)
            self.model.free(r.request_id)
            del self.live[r.request_id]
            expect(r.block_table == [], f"{self.log[-1]}: a freed request keeps blocks")
        self.check()

    def check(self) -> None:
        """Agreement with the model plus the table invariants."""
        where = self.log[-1] if self.log else "start"
        free = self.model.num_free + self.model.num_evictable
        expect(self.m.num_free_blocks == free, f"{where}: num_free_blocks "
               f"{self.m.num_free_blocks}, model {free}")
        to_vid: dict[int, int] = {}
        to_block: dict[int, int] = {}
        for rid, r in self.live.items():
            table, vids = r.block_table, self.model.tables[rid]
            expect(len(set(table)) == len(table), f"{where}: {rid} holds a block twice")
            expect(len(table) == len(vids), f"{where}: {rid} table {table}, model {vids}")
            expect(len(table) * self.m.block_size >= r.num_computed_tokens, f"{where}: short table")
            for b, v in zip(table, vids):
                expect(to_vid.setdefault(b, v) == v and to_block.setdefault(v, b) == b,
                       f"{where}: block {b} shared differently from the model")
        if self.after_op is not None:
            self.after_op(list(self.live.values()))

    def drain(self) -> None:
        """Free every live request; the pool must be whole again (idle check)."""
        for r in list(self.live.values()):
            self.m.free(r)
            self.model.free(r.request_id)
        self.live.clear()
        self.log.append("drain")
        self.check()
        expect(self.m.num_free_blocks == self.m.num_blocks, "idle: blocks leaked")


def register_manager_checks(suite: Suite[ManagerFactory],
                            reference: Callable[[], EvictionPolicy] | None = None) -> None:
    """Add every KVCacheManager check to ``suite``, its model evicting in the order of
    policies ``reference()`` builds (``None``: exact LRU; called once per suite by
    testing.cache)."""

    @suite.check
    def check_fresh_manager_is_empty(factory: ManagerFactory) -> None:
        m = factory(8, P)
        expect((m.num_blocks, m.block_size, m.num_free_blocks) == (8, P, 8), "fresh manager")
        expect(m.match_prefix(make_request("a", list(range(20)))) == 0, "an empty cache matches nothing")

    @suite.check
    def check_full_prompt_hit_leaves_one_token(factory: ManagerFactory) -> None:
        m = factory(16, P)
        admit(m, make_request("a", list(range(3 * P))))
        got = m.match_prefix(make_request("b", list(range(3 * P))))
        expect(got == 2 * P, f"a full-prompt hit must leave the last block, got {got}")
        got = m.match_prefix(make_request("c", list(range(3 * P + 1))))
        expect(got == 3 * P, f"one extra token allows the full hit, got {got}")

    @suite.check
    def check_publish_only_after_commit(factory: ManagerFactory) -> None:
        m = factory(16, P)
        a = make_request("a", list(range(3 * P)))
        m.allocate(a, 3 * P)
        b = make_request("b", list(range(3 * P)))
        expect(m.match_prefix(b) == 0, "blocks whose step has not committed must not match")
        a.num_computed_tokens = 3 * P
        m.cache_full_blocks(a, 2 * P)
        expect(m.match_prefix(b) == 2 * P, "cache_full_blocks publishes the given prefix")

    @suite.check
    def check_failed_allocation_changes_nothing(factory: ManagerFactory) -> None:
        m = factory(4, P)
        a = make_request("a", list(range(3 * P)))
        admit(m, a)
        b = make_request("b", list(range(100, 100 + 2 * P)))
        table, free = list(a.block_table), m.num_free_blocks
        expect(not m.can_allocate(b, 2 * P), "can_allocate must see the pool is short")
        try:
            m.allocate(b, 2 * P)
        except OutOfBlocksError:
            pass
        else:
            raise AssertionError("allocate beyond the pool must raise OutOfBlocksError")
        expect((a.block_table, b.block_table, m.num_free_blocks) == (table, [], free),
               "a failed allocation changed the cache")

    @suite.check
    def check_fork_copies_partial_block_on_write(factory: ManagerFactory) -> None:
        m = factory(16, P)
        parent = make_request("p", list(range(2 * P + 2)))
        admit(m, parent)
        child = make_request("p#1", parent.all_token_ids)
        m.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        expect(child.block_table == parent.block_table, "a fork shares every block")
        free = m.num_free_blocks
        copies = m.allocate(child, 1)
        expect(copies == [(parent.block_table[2], child.block_table[2])],
               f"the shared partial block must be copied once, got {copies}")
        expect(child.block_table[:2] == parent.block_table[:2], "full blocks stay shared")
        expect(m.num_free_blocks == free - 1, "a copy takes exactly one block")
        expect(m.allocate(parent, 1) == [], "the other holder then writes in place")

    @suite.check
    def check_truncate_and_free_return_blocks(factory: ManagerFactory) -> None:
        m = factory(8, P)
        a = make_request("a", list(range(3 * P)))
        m.allocate(a, 3 * P)
        m.truncate(a, P + 1)
        expect(len(a.block_table) == 2 and m.num_free_blocks == 6, "truncate keeps 2 blocks")
        m.free(a)
        m.free(a)
        expect(a.block_table == [] and m.num_free_blocks == 8, "free returns every block")

    @suite.check
    def check_stats_count_queries_hits_and_inserts(factory: ManagerFactory) -> None:
        m = factory(16, P)
        stats = m.stats
        expect(stats is not None, "stats must be a record while prefix caching is on")
        assert stats is not None
        expect((stats.queries, stats.hit_blocks) == (0, 0), f"fresh stats: {stats}")
        admit(m, make_request("a", list(range(3 * P))))
        stats = m.stats
        assert stats is not None
        queries, hits, inserted = stats.queries, stats.hit_blocks, stats.inserted_blocks
        expect(inserted == 3, f"publishing 3 full blocks counts 3 inserts, got {inserted}")
        got = m.match_prefix(make_request("b", list(range(2 * P)) + [99] * (P + 1)))
        stats = m.stats
        assert stats is not None
        expect(got == 2 * P, f"b shares 2 blocks with a, matched {got} tokens")
        expect(stats.queries == queries + 1, f"a match counts one query: {queries} -> {stats.queries}")
        expect(stats.hit_blocks == hits + 2, f"a 2-block hit counts 2: {hits} -> {stats.hit_blocks}")

    @suite.check
    def check_integrity_passes_when_healthy_and_names_a_duplicate(factory: ManagerFactory) -> None:
        m = factory(16, P)
        a = make_request("a", list(range(2 * P + 1)))
        b = make_request("b", list(range(3 * P)))
        admit(m, a)
        admit(m, b)
        m.check_integrity()
        m.check_integrity([a, b])
        dup = a.block_table[0]
        a.block_table.append(dup)
        try:
            m.check_integrity([a, b])
        except InvariantError as exc:
            expect(str(dup) in str(exc), f"the error must name the block at fault: {exc}")
        else:
            raise AssertionError("check_integrity must raise InvariantError on a block twice in a table")
        a.block_table.pop()
        try:
            m.check_integrity([b])
        except InvariantError:
            pass
        else:
            raise AssertionError("check_integrity must raise when a holder of blocks is missing")
        m.free(a)
        m.free(b)
        m.check_integrity(())

    @suite.check
    def check_reset_prefix_cache_empties_the_index_only_when_idle(factory: ManagerFactory) -> None:
        m = factory(16, P)
        a = make_request("a", list(range(3 * P + 1)))
        admit(m, a)
        b = make_request("b", list(range(3 * P + 1)))
        expect(not m.reset_prefix_cache(), "reset must be refused while a request holds blocks")
        expect(m.match_prefix(b) == 3 * P, "a refused reset must change nothing")
        m.free(a)
        free = m.num_free_blocks
        expect(m.reset_prefix_cache(), "reset must succeed once nothing is referenced")
        expect(m.match_prefix(b) == 0, "after a reset nothing matches")
        expect(m.num_free_blocks == free == 16, f"a reset keeps every block free: {m.num_free_blocks}")
        m.check_integrity(())
        admit(m, b)
        m.free(b)
        c = make_request("c", list(range(3 * P + 1)))
        expect(m.match_prefix(c) == 3 * P, "blocks published after a reset are cached again")
        expect(m.reset_prefix_cache() and m.reset_prefix_cache(), "a reset of an empty cache succeeds")

    @suite.check
    def check_random_operations_against_the_reference_model(factory: ManagerFactory) -> None:
        for seed in range(3):
            driver = ManagerShadowDriver(factory(12, P), seed, reference=reference)
            for _ in range(250):
                driver.step()
            driver.drain()
