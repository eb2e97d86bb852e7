"""Conformance suite for a KV cache manager with sliding-window groups
(``cache.hybrid_manager.HybridKVCacheManager`` and any manager offering the same members).

The checks drive the manager as a scheduler and a runner would — admissions with prefix
hits, chunked prefills, decodes, speculative rounds rolled back, forks, frees — and keep a
model of the device: the K/V "written" into each group's blocks through the mappings the
manager hands out (``drain_table_updates``). After every step each sequence must read back,
through its block table and the mappings, the right token at every position of its
window (every position, in the full group), the windows must stay within their bound,
and a failed allocation must change nothing.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Protocol

from deepinfer_kit.cache.layer_groups import KVLayout, SlidingWindowSpec
from deepinfer_kit.cache.protocols import KVCacheManager, wrapped_member
from deepinfer_kit.cache.tiers.records import TransferOutput
from deepinfer_kit.errors import OutOfBlocksError
from deepinfer_kit.request import Request
from deepinfer_kit.testing.cache_manager_checks import make_request
from deepinfer_kit.testing.suite import Suite, expect

__all__ = ["WindowedManager", "HybridManagerFactory", "HYBRID_KV_CACHE_MANAGER_SUITE", "WindowDeviceModel"]


class WindowedManager(KVCacheManager, Protocol):
    """A :class:`KVCacheManager` whose sliding-window groups map full-group blocks to their own."""

    layout: KVLayout

    def drain_table_updates(self) -> list[tuple[int, int, int]]:
        """``(group, full_block, group_block)`` mappings set since the last drain."""
        ...

    def window_blocks(self, request: Request) -> list[list[int]]:
        """Per sliding group, the full-group blocks ``request`` holds there."""
        ...


HybridManagerFactory = Callable[[int, int, KVLayout, int, int], WindowedManager]
"""``factory(num_blocks, block_size, layout, sliding_blocks, replay_limit)`` -> a fresh manager
(prefix caching on) over ``layout``'s groups, each sliding group with ``sliding_blocks``
blocks, serving evicted windows by bounded replays of at most ``replay_limit`` tokens (0:
none; a manager without replays ignores it)."""


class WindowDeviceModel:
    """What the device holds: each group's blocks' token ids, written through the
    mappings the manager handed out."""

    def __init__(self, m: WindowedManager) -> None:
        self.m = m
        self.maps: dict[tuple[int, int], int] = {}
        self.slots: dict[tuple[int, int, int], int | None] = {}  # None: K/V a replay wrote wrong

    def apply(self) -> None:
        """Apply the drained mappings (what the runner does before a forward)."""
        for g, full, own in self.m.drain_table_updates():
            self.maps[(g, full)] = own

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write of full-group blocks, in every group holding both."""
        P = self.m.block_size
        for src, dst in pairs:
            for g in range(self.m.layout.num_groups):
                s, d = (src, dst) if g == 0 else (self.maps.get((g, src)), self.maps.get((g, dst)))
                if s is not None and d is not None:
                    for o in range(P):
                        if (g, s, o) in self.slots:
                            self.slots[(g, d, o)] = self.slots[(g, s, o)]

    def _where(self, g: int, r: Request, pos: int) -> tuple[int, int, int] | None:
        P = self.m.block_size
        full = r.block_table[pos // P]
        own = full if g == 0 else self.maps.get((g, full))
        return None if own is None else (g, own, pos % P)

    def write(self, r: Request, start: int, n: int, shared: int = 0, exact: int = 0) -> None:
        """The forward writes the K/V of positions ``start .. start + n - 1`` in every group;
        a bounded replay's rows before ``shared`` skip the full group (its K/V is the
        cache's), and the sliding K/V it writes before ``exact`` is wrong (``None``: a read
        of it fails the checks)."""
        for g in range(self.m.layout.num_groups):
            for pos in range(max(start, shared) if g == 0 else start, start + n):
                where = self._where(g, r, pos)
                expect(where is not None, f"{r.request_id}: group {g} has no block for position {pos}")
                assert where is not None
                self.slots[where] = r.all_token_ids[pos] if g == 0 or pos >= exact else None

    def prefill(self, r: Request, cached: int = 0) -> None:
        """Allocate, map and write ``r``'s whole prompt after a hit of ``cached`` tokens in
        one step, check the reads, and mark it computed."""
        n = r.num_tokens - cached
        self.m.allocate(r, n, cached)
        self.apply()
        r.num_computed_tokens = cached
        self.write(r, cached, n)
        self.check_reads(r, cached, n)
        r.num_computed_tokens = r.num_tokens

    def check_reads(self, r: Request, start: int, n: int) -> None:
        """Every position each new token attends to reads its own token, in every group."""
        for g, spec in enumerate(self.m.layout.specs):
            first = max(0, start - spec.window + 1) if isinstance(spec, SlidingWindowSpec) else 0
            for pos in range(first, start + n):
                where = self._where(g, r, pos)
                got = None if where is None else self.slots.get(where)
                expect(got == r.all_token_ids[pos],
                       f"{r.request_id}: group {g} reads {got} at position {pos}, wrote {r.all_token_ids[pos]}")


class _Driver:
    """Random scheduler-like operations with the device model kept in step."""

    def __init__(self, m: WindowedManager, seed: int, tail_blocks: int = 8) -> None:
        self.m, self.rng, self.dev = m, random.Random(seed), WindowDeviceModel(m)
        self.live: dict[str, Request] = {}
        self.chunk: dict[str, int] = {}  # each sequence's last chunk: its window's bound grows with it
        self.n = 0
        self.rounds = 0  # the KV tiers' rounds (step ids)
        self.host: dict[int, dict[tuple[int, int], int | None]] = {}  # host slot -> (group, offset) -> token
        self.loaded_windows = 0  # sliding groups' blocks the tiers' loads filled
        P = m.block_size
        common = [self.rng.randrange(3) for _ in range(6 * P)]
        self.bases = [common + [self.rng.randrange(3) for _ in range(tail_blocks * P)] for _ in range(3)]

    def run(self, r: Request, n: int, cached: int = 0, first: int | None = None) -> bool:
        """One round of ``r`` alone (:meth:`run_round`); False when the manager refused."""
        return bool(self.run_round([(r, n, cached, first)]))

    def _admit(self, r: Request) -> tuple[Request, int, int, int | None]:
        """Match a new request now (as a scheduler does just before allocating it) and pick
        its first chunk."""
        cached = self.m.match_prefix(r)
        replay_start = getattr(self.m, "replay_start", None)
        first = replay_start(r, cached) if replay_start is not None and cached else cached
        return r, self.rng.randint(1, r.num_tokens - cached), cached, first

    def run_round(self, chunks: list[tuple[Request, int | None, int, int | None]]) -> list[tuple[Request, int]]:
        """One round: allocate each ``(request, n, cached, first)`` in order (``n`` None: a
        new request, matched right before its allocation; a refused one must change
        nothing), apply the mappings and copies, run the tiers' copies, write (from
        ``first``, a bounded replay's start, when given) and check the reads. Returns each
        request that got its blocks, with its chunk."""
        ran: list[tuple[Request, int, int, int | None]] = []
        copies: list[tuple[int, int]] = []
        for item in chunks:
            r, n, cached, first = self._admit(item[0]) if item[1] is None else item
            assert n is not None
            start = r.num_computed_tokens if r.block_table else cached
            before = (list(r.block_table), [list(w) for w in self.m.window_blocks(r)], self.m.num_free_blocks)
            try:
                copies += self.m.allocate(r, n, cached)
            except OutOfBlocksError:
                after = (list(r.block_table), [list(w) for w in self.m.window_blocks(r)], self.m.num_free_blocks)
                expect(after == before, f"{r.request_id}: a refused allocation changed {before} into {after}")
                continue
            self.chunk[r.request_id] = n + (start - first if first is not None else 0)
            ran.append((r, n, start, first))
        if not ran:
            return []
        self.dev.apply()
        self.dev.copy(copies)
        self._tier_round()
        for r, n, start, first in ran:
            r.num_computed_tokens = start
            if first is not None and first < start:
                layout = self.m.layout
                exact = first + layout.replay_bound - max(s.window for _, s in layout.sliding())
                self.dev.write(r, first, start + n - first, shared=start, exact=exact)
            else:
                self.dev.write(r, start, n)
        for r, n, start, _ in ran:
            self.dev.check_reads(r, start, n)
        return [(r, n) for r, n, _, _ in ran]

    def _tier_round(self) -> None:
        """With KV tiers under the manager (its ``drain_kv_transfers``, found down the
        ``inner`` chain), run the round's copies on the device model: a save keeps what the
        device holds in the block (and, for a plan carrying ``save_groups``, in each
        group's block for it), a load writes it back (into each group's block of
        ``load_groups``; without them the sliding groups get nothing). Every save is
        reported done."""
        drain = wrapped_member(self.m, "drain_kv_transfers")
        if drain is None:
            return
        self.rounds += 1
        plan = drain(self.rounds)
        P, dev = self.m.block_size, self.dev
        for i, (block, slot) in enumerate(plan.saves):
            owns = [(0, block)] + [(g, own[i]) for g, own in plan.save_groups.items()]
            self.host[slot] = {(g, o): dev.slots.get((g, b, o)) for g, b in owns for o in range(P)}
        for i, (slot, block) in enumerate(plan.loads):
            saved = self.host.get(slot, {})  # a slot no save filled loads garbage (None)
            owns = [(0, block)] + [(g, own[i]) for g, own in plan.load_groups.items() if own[i] >= 0]
            for g, b in owns:
                for o in range(P):
                    dev.slots[(g, b, o)] = saved.get((g, o))
        self.loaded_windows += sum(1 for own in plan.load_groups.values() for b in own if b >= 0)
        wrapped_member(self.m, "finish_kv_transfers")(self.rounds, TransferOutput(saved=[s for _, s in plan.saves]))

    def step(self) -> None:
        rng, m = self.rng, self.m
        P = m.block_size
        op = rng.randrange(7)
        r = self.live[rng.choice(sorted(self.live))] if self.live else None
        if op == 0 or r is None:
            admitted: list[tuple[Request, int | None, int, int | None]] = []
            for _ in range(1 if rng.randrange(3) else 2):  # one new request, or two in one round
                base = rng.choice(self.bases)
                admitted.append((make_request(f"r{self.n}", base[: rng.randint(1, len(base))]), None, 0, None))
                self.n += 1
            ran = dict((q.request_id, n) for q, n in self.run_round(admitted))
            for new, _, _, _ in admitted:
                if new.request_id in ran:
                    self.live[new.request_id] = new
                    new.num_computed_tokens += ran[new.request_id]
                    m.cache_full_blocks(new, new.num_computed_tokens)
                else:
                    m.free(new)
        elif op in (1, 2):
            if r.num_computed_tokens == r.num_tokens:
                r.all_token_ids.append(rng.randrange(3))
            n = rng.randint(1, r.num_tokens - r.num_computed_tokens)
            if self.run(r, n):
                r.num_computed_tokens += n
                m.cache_full_blocks(r, r.num_computed_tokens)
        elif op == 3 and r.num_computed_tokens == r.num_tokens:
            k = rng.randint(1, 3)
            start = r.num_computed_tokens
            r.all_token_ids.extend(rng.randrange(3) for _ in range(k))
            if self.run(r, k):
                accepted = rng.randint(0, k - 1)
                del r.all_token_ids[start + accepted + 1:]
                r.num_computed_tokens = start + accepted + 1
                m.truncate(r, r.num_computed_tokens)
                m.cache_full_blocks(r, r.num_computed_tokens)
            else:
                del r.all_token_ids[start:]
        elif op == 4:
            child = make_request(f"{r.request_id}#{self.n}", r.all_token_ids)
            self.n += 1
            child.num_computed_tokens = r.num_computed_tokens
            self.chunk[child.request_id] = self.chunk.get(r.request_id, 1)
            m.fork(r, child)
            self.live[child.request_id] = child
        else:
            m.free(r)
            del self.live[r.request_id]
        m.check_integrity(list(self.live.values()))
        for req in self.live.values():
            for spec, held in zip([s for _, s in m.layout.sliding()], m.window_blocks(req)):
                bound = spec.max_blocks(P, self.chunk.get(req.request_id, 1))
                expect(len(held) <= bound,
                       f"{req.request_id}: holds {len(held)} blocks in a window of {spec.window}, bound {bound}")


def _check_random_operations_keep_every_window_readable(factory: HybridManagerFactory) -> None:
    """Also with bounded replays (the sliding K/V a replay writes before its first exact
    position is modelled as wrong: no window may ever read it), and over KV tiers when the
    manager has them (a tier slot keeps what the device held in the blocks its save read,
    and a load writes it back: a window saved stale or loaded into the wrong block is read
    back wrong)."""
    replays = 0
    for seed in range(6):
        for replay_limit, full in ((0, 48), (64, 64), (64, 32)):
            layout = KVLayout.from_windows([None, 5, 5, 9], backtrack=3)
            # with replays: long prompts over a small sliding pool, so windows are evicted (and
            # over a small full pool, so prefixes are too: a manager over KV tiers loads them)
            m = factory(full, 4, layout, 16, replay_limit) if replay_limit else factory(full, 4, layout, 40, 0)
            driver = _Driver(m, seed, 20 if replay_limit else 8)
            for _ in range(150):
                driver.step()
            for r in list(driver.live.values()):
                m.free(r)
            m.check_integrity(())
            expect(m.num_free_blocks == m.num_blocks, "idle: full-group blocks leaked")
            stats = getattr(m, "window_stats", None)
            replays += getattr(stats, "replays", 0)
    expect(replays > 0 or not hasattr(factory(8, 4, KVLayout.from_windows([None, 5]), 8, 64), "replay_start"),
           "no bounded replay ran: the check did not exercise them")


def _check_decode_holds_at_most_the_window(factory: HybridManagerFactory) -> None:
    layout = KVLayout.from_windows([None, 6], backtrack=2)
    P = 4
    m = factory(64, P, layout, 12, 0)
    dev = WindowDeviceModel(m)
    r = make_request("long", list(range(5)))
    dev.prefill(r)
    bound = layout.sliding()[0][1].max_blocks(P)
    for t in range(150):  # far longer than the sliding pool could hold whole
        r.all_token_ids.append(t % 7)
        start = r.num_computed_tokens
        m.allocate(r, 1)
        dev.apply()
        dev.write(r, start, 1)
        dev.check_reads(r, start, 1)
        r.num_computed_tokens += 1
        (held,) = m.window_blocks(r)
        expect(len(held) <= bound, f"decode at {start}: {len(held)} window blocks, bound {bound}")
    m.free(r)
    m.check_integrity(())


def _check_prefix_hit_needs_the_window(factory: HybridManagerFactory) -> None:
    layout = KVLayout.from_windows([None, 5])
    P = 4
    m = factory(64, P, layout, 12, 0)
    dev = WindowDeviceModel(m)

    def prefill(r: Request, cached: int) -> None:
        dev.prefill(r, cached)
        m.cache_full_blocks(r, r.num_tokens)

    prompt = list(range(30))
    a = make_request("a", prompt)
    prefill(a, 0)
    m.free(a)  # its published blocks' windows stay idle: a later request may hit them
    b = make_request("b", prompt + [99])
    hit = m.match_prefix(b)
    expect(hit == 28, f"a hit whose window is still cached keeps its length: got {hit}, want 28")
    # Others' windows fill the sliding pool: some idle windows are evicted, the hit shrinks
    # to one whose window is still there, and reads through it are right.
    others = [make_request(f"o{i}", [100 + i] * 9) for i in range(3)]
    for o in others:
        prefill(o, 0)
    c = make_request("c", prompt + [98])
    hit = m.match_prefix(c)
    expect(hit % P == 0 and hit < 28, f"hit {hit} after its window's eviction")
    for o in others:
        m.free(o)
    prefill(c, hit)
    m.free(c)
    m.check_integrity(())


def _check_short_sliding_pool_refuses_and_changes_nothing(factory: HybridManagerFactory) -> None:
    layout = KVLayout.from_windows([None, 8])
    m = factory(64, 4, layout, 5, 0)
    a = make_request("a", list(range(30)))
    try:
        m.allocate(a, 30)  # a 30-token chunk needs 8 window blocks at once
    except OutOfBlocksError:
        expect(a.block_table == [] and m.num_free_blocks == m.num_blocks, "a refused allocation took blocks")
    else:
        expect(False, "30 tokens in one chunk fit a 5-block sliding pool")
    m.allocate(a, 4)  # a small chunk fits
    m.free(a)
    m.check_integrity(())


def _check_rollback_within_backtrack_keeps_the_window(factory: HybridManagerFactory) -> None:
    """A round planned on tokens still in flight (overlap, drafts) starts up to
    ``backtrack`` tokens too far; after the rollback the window below is still held."""
    back = 3
    layout = KVLayout.from_windows([None, 6], backtrack=back)
    P = 4
    m = factory(64, P, layout, 16, 0)
    dev = WindowDeviceModel(m)
    r = make_request("r", list(range(9)))
    dev.prefill(r)
    for t in range(40):
        true_start = r.num_computed_tokens
        ahead = t % (back + 1)  # tokens planned past the committed ones
        r.all_token_ids.extend(50 + (t + i) % 5 for i in range(ahead + 1))
        r.num_computed_tokens = true_start + ahead
        m.allocate(r, 1)
        dev.apply()
        dev.write(r, true_start, ahead + 1)
        del r.all_token_ids[true_start + 1:]  # the tokens past the first are rejected
        r.num_computed_tokens = true_start + 1
        m.truncate(r, r.num_computed_tokens)
        dev.check_reads(r, true_start, 1)
    m.free(r)
    m.check_integrity(())


HYBRID_KV_CACHE_MANAGER_SUITE: Suite[HybridManagerFactory] = Suite(
    "HybridKVCacheManager", "factory(num_blocks, block_size, layout, sliding_blocks, replay_limit) -> WindowedManager")
for _check in (_check_random_operations_keep_every_window_readable, _check_decode_holds_at_most_the_window,
               _check_prefix_hit_needs_the_window, _check_short_sliding_pool_refuses_and_changes_nothing,
               _check_rollback_within_backtrack_keeps_the_window):
    HYBRID_KV_CACHE_MANAGER_SUITE.check(_check)
