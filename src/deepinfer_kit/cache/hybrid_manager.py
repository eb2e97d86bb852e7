"""HybridKVCacheManager: one KVCacheManager over layer groups with different cache specs — a
full-attention group and sliding-window groups that keep only each sequence's window.

The full group is an ordinary manager (block tables, prefix index, forks, copy-on-write;
``BlockKVCacheManager`` by default); its table names every token's logical block. Each
sliding group (:class:`~deepinfer_kit.cache.window_map.WindowBlockMap`) holds, per
sequence, its own blocks for the full-group blocks the sequence's window still reads:
blocks wholly before ``start - window + 1 - backtrack`` are released as the sequence moves
on, so a sliding group holds at most ``SlidingWindowSpec.max_blocks`` blocks a sequence
(with ``backtrack`` tokens of room for a speculative rollback). A prefix hit is kept only
as long as every sliding group still holds the window before its end, or, when that
window was evicted, served whole by a bounded replay (:meth:`replay_start`: the sliding
layers recompute the last ``KVLayout.replay_bound`` tokens before it; docs/hybrid_kv_cache.md).

Every call that changes a table goes to the full group first, then the sliding groups
(:meth:`_sync`); what they cannot hold is refused before the full group changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, cast

from deepinfer_kit.cache.layer_groups import KVLayout, SlidingWindowSpec
from deepinfer_kit.cache.prefix_state import PrefixState
from deepinfer_kit.cache.protocols import BlockAllocator, KVCacheManager, PrefixIndex
from deepinfer_kit.cache.records import PrefixCacheStats, SlotGrant, WindowHitStats
from deepinfer_kit.cache.replay_marks import ReplayMarks
from deepinfer_kit.cache.slots import allocate_slots
from deepinfer_kit.cache.window_map import WindowBlockMap, WindowHold, index_of, replay_start_of
from deepinfer_kit.errors import ConfigError, InvariantError, OutOfBlocksError
from deepinfer_kit.request import Request

__all__ = ["HybridKVCacheManager", "TableUpdate"]

TableUpdate = tuple[int, int, int]
"""``(group, full_block, group_block)``: from now on, the sliding group ``group`` holds the
K/V of full-group block ``full_block`` in its block ``group_block``."""


class HybridKVCacheManager:
    """A :class:`KVCacheManager` over a full group and sliding-window groups.

    Args:
        inner: the full group's manager (it owns ``request.block_table`` and the prefix
            index); must hold no blocks yet.
        layout: the model's groups (``KVLayout.from_windows``); its sliding groups get a
            pool each.
        sliding_blocks: blocks in each sliding group's pool (one int for all, or one per
            sliding group, in group order).
        replay_limit: the longest bounded replay to run (tokens recomputed before a hit's
            end so the windows before it come out exact, ``KVLayout.replay_bound``); 0: never
            replay (a hit is shortened to a cached window instead). A scheduler must fit
            the replay and one more token in one chunk: keep it within a round's budget.

    Raises:
        ConfigError: a layout without sliding groups, or a pool size below 1 / of the
            wrong count.
    """

    _tier_windows = False  # the KV tiers under the full group keep windows (cache.tiers.hybrid)

    def __init__(self, inner: KVCacheManager, layout: KVLayout, sliding_blocks: int | Sequence[int], *,
                 replay_limit: int = 0) -> None:
        sliding = layout.sliding()
        if not sliding:
            raise ConfigError("HybridKVCacheManager needs a layout with a sliding-window group")
        sizes = [sliding_blocks] * len(sliding) if isinstance(sliding_blocks, int) else list(sliding_blocks)
        if len(sizes) != len(sliding):
            raise ConfigError(f"sliding_blocks must give {len(sliding)} pool sizes, got {sizes}")
        self._inner = inner
        self._P = inner.block_size
        self.layout = layout
        self._groups: list[tuple[int, SlidingWindowSpec, WindowBlockMap]] = [
            (g, spec, WindowBlockMap(n, self._P)) for (g, spec), n in zip(sliding, sizes)]
        self._windows: dict[str, list[WindowHold]] = {}
        self._replay_bound = layout.replay_bound
        self._replay_limit = replay_limit
        self._replays: dict[str, tuple[int, int]] = {}  # request id -> (hit end, replay start)
        self._marks, self._maps = ReplayMarks(), [m for _, _, m in self._groups]
        self.window_stats = WindowHitStats()
        """Live counters of the hits the windows shortened."""

    # ---------------------------------------------------------------- reading

    @property
    def inner(self) -> KVCacheManager:
        """The full group's manager (read it; mutate only through this manager)."""
        return self._inner

    @property
    def allocator(self) -> BlockAllocator:
        """The full group's block pool, when its manager exposes one (read it only).

        Raises:
            AttributeError: the full group's manager has no ``allocator``.
        """
        return cast(BlockAllocator, getattr(self._inner, "allocator"))

    @property
    def index(self) -> PrefixIndex | None:
        """The full group's prefix index (``None``: caching off or none exposed)."""
        return index_of(self._inner)

    @property
    def block_size(self) -> int:
        """Tokens per block (``P``), the same in every group."""
        return self._P

    @property
    def num_blocks(self) -> int:
        """Blocks in the full group's pool (the ids block tables hold)."""
        return self._inner.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """The full group's free plus evictable blocks. O(1)."""
        return self._inner.num_free_blocks

    @property
    def stats(self) -> PrefixCacheStats | None:
        """The full group's prefix-index counters (hits before the windows shortened them)."""
        return self._inner.stats

    @property
    def usage(self) -> float:
        """Fraction of the fullest pool held by sequences."""
        fractions = [m.num_held / m.num_blocks for _, _, m in self._groups]
        return max([1.0 - self.num_free_blocks / self.num_blocks, *fractions])

    def group_maps(self) -> list[tuple[int, WindowBlockMap]]:
        """``(group, map)`` of every sliding group (read them; the manager mutates them)."""
        return [(g, m) for g, _, m in self._groups]

    def window_blocks(self, request: Request) -> list[list[int]]:
        """Per sliding group, the full-group blocks ``request`` holds there (its window)."""
        windows = self._windows.get(request.request_id)
        return [list(w.held) for w in windows] if windows else [[] for _ in self._groups]

    def drain_table_updates(self) -> list[TableUpdate]:
        """The ``(group, full_block, group_block)`` mappings set since the last drain, in
        order (the scheduler puts them on the round's plan; the runner applies them to the
        device map before that round's forward). Clears them."""
        out: list[TableUpdate] = []
        for g, _, m in self._groups:
            out += [(g, full, own) for full, own in m.drain_updates()]
        return out

    # ---------------------------------------------------------------- prefix hits

    def match_prefix(self, request: Request) -> int:
        """The full group's hit, shortened by whole blocks until every sliding group still
        holds the window before its end (tokens ``end - window + 1 .. end - 1``), or served
        whole by a bounded replay. Over KV tiers the hit may reach past the device's blocks
        (their windows come with them: ``cache.tiers.hybrid``). Changes no reference count."""
        hit = self._inner.match_prefix(request)
        st = request.prefix_state
        if not hit or not isinstance(st, PrefixState):
            return 0
        blocks = st.hits
        P = self._P
        stats = self.window_stats
        stats.queries += 1
        stats.full_hit_tokens += hit
        full = hit
        while hit > 0 and not self._window_cached(blocks, hit):
            hit -= P
        stats.kept_tokens += hit
        stats.replay_tokens += min(full - hit, self._replay_bound)
        start = replay_start_of(full, hit, blocks, self._replay_bound, self._replay_limit, P,
                                [m for _, _, m in self._groups])
        if start is None:
            self._replays.pop(request.request_id, None)
            return hit
        self._replays[request.request_id] = (full, start)
        return full

    def replay_start(self, request: Request, num_cached_tokens: int) -> int:
        """Where the first chunk of ``request`` (holding no blocks) must start computing
        after a :meth:`match_prefix` hit of ``num_cached_tokens``: the hit itself, or for a
        hit served by a bounded replay the replay's start (its full-layer K/V is the cache's;
        the rows before the hit write only the sliding groups). The chunk must reach past
        the hit in one step. Pure."""
        replay = self._replays.get(request.request_id)
        return replay[1] if replay is not None and replay[0] == num_cached_tokens else num_cached_tokens

    def _window_cached(self, blocks: list[int], end: int) -> bool:
        P = self._P
        if end > len(blocks) * P and not self._tier_windows:  # blocks a tier loads: windowed if it keeps them
            return False
        for _, spec, m in self._groups:
            first = max(0, end - spec.window + 1) // P
            if not all(m.cached(b) for b in blocks[first:end // P]):
                return False
        return True

    # ---------------------------------------------------------------- allocation

    def can_allocate(self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        """True when :meth:`allocate` with the same arguments would succeed now (the sliding
        groups' count is an upper bound: it may refuse an allocation that would just fit).
        Pure."""
        start = request.num_computed_tokens if request.block_table else num_cached_tokens
        first = start if request.block_table else self.replay_start(request, num_cached_tokens)
        return (self._inner.can_allocate(request, num_new_tokens, num_cached_tokens)
                and self._sliding_fits(request, first, start + num_new_tokens))

    def allocate(self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0) -> list[tuple[int, int]]:
        """See :meth:`KVCacheManager.allocate`; the sliding groups then take the new
        window's blocks, release those it left and forget stale windows of fresh blocks.

        Raises:
            OutOfBlocksError: the full group or a sliding group is short; nothing changed.
            InvariantError: as the full group's manager.
        """
        table = request.block_table
        start = request.num_computed_tokens if table else num_cached_tokens
        first = start if table else self.replay_start(request, num_cached_tokens)
        if not self._sliding_fits(request, first, start + num_new_tokens):
            raise OutOfBlocksError(
                f"request {request.request_id!r}: a sliding-window group has too few free blocks "
                f"for {num_new_tokens} tokens")
        st = request.prefix_state
        if not table and num_cached_tokens and first == start:
            matched = st.hits if isinstance(st, PrefixState) else []
            if not self._window_cached(matched, num_cached_tokens):
                raise InvariantError(
                    f"allocate: num_cached_tokens={num_cached_tokens} for request {request.request_id!r} is "
                    f"not a current match_prefix result (a sliding window before it is not cached)")
        fresh = len(table) or min(len(st.hits) if isinstance(st, PrefixState) else 0, num_cached_tokens // self._P)
        copies = self._inner.allocate(request, num_new_tokens, num_cached_tokens)
        for _, _, m in self._groups:  # blocks new to the full group (a tier's loads too): old windows are stale
            m.forget_idle(request.block_table[fresh:])
        if first < start:  # a bounded replay: its windows start at the replay
            del self._replays[request.request_id]
            self._sync(request, first, replay=True)
            self._count_replay(request, first, start)
        else:
            self._sync(request, start)
        return copies

    def _count_replay(self, request: Request, first: int, end: int) -> None:
        """Count a replay from ``first`` to the hit's ``end``; mark the blocks it writes
        (:class:`ReplayMarks`: readable from its first exact position, once committed)."""
        stats = self.window_stats
        stats.replays += 1
        stats.replayed_tokens += end - first
        exact = first + self._replay_bound - max(spec.window for _, spec, _ in self._groups)
        self._marks.start(request.request_id, self._maps, self._windows[request.request_id], exact, end, self._P)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_computed_tokens: int | None = None) -> SlotGrant:
        """:func:`~deepinfer_kit.cache.slots.allocate_slots` over this manager."""
        return allocate_slots(self, request, num_new_tokens, num_computed_tokens)

    def allocate_next_blocks(self, requests: Sequence[Request]) -> int:
        """One fresh block onto each table, in order, while every group has room; returns
        how many got one (see :meth:`KVCacheManager.allocate_next_blocks`)."""
        got = 0
        for req in requests:  # one at a time: the same blocks as one call (its contract)
            if not self._sliding_fits(req, req.num_computed_tokens, (len(req.block_table) + 1) * self._P):
                break
            if not self._inner.allocate_next_blocks((req,)):
                break
            self._sync(req, req.num_computed_tokens)
            got += 1
        return got

    def _sliding_fits(self, request: Request, start: int, end: int, extra: int = 0) -> bool:
        """Whether every sliding group could give ``request`` the window of tokens
        ``start .. end - 1`` (an upper bound on what it takes, plus ``extra`` blocks
        promised to others)."""
        P = self._P
        new_len = max(len(request.block_table), -(-end // P))
        windows = self._windows.get(request.request_id)
        for k, (_, spec, m) in enumerate(self._groups):
            w = windows[k] if windows else None
            lo = self._new_lo(w, spec, start)
            held_hi = w.lo + len(w.held) if w is not None else 0
            mine = max(0, min(held_hi, new_len) - max(lo, w.lo)) if w is not None else 0
            need = (new_len - lo) - mine + 1 + extra  # + 1: a copy-on-write of the last block
            freed = 0
            if w is not None:
                freed = sum(1 for j, b in enumerate(w.held, w.lo) if j < lo and m.holders(b) == 1)
            if need > m.num_available + freed:
                return False
        return True

    def _new_lo(self, w: WindowHold | None, spec: SlidingWindowSpec, start: int) -> int:
        """First logical block a sequence whose next step starts at ``start`` keeps: the
        window's first block, less ``backtrack`` tokens of room, never moving back (a
        rollback stays within that room); a sequence holding nothing keeps no room."""
        if w is None or not w.held:
            return max(0, start - spec.window + 1) // self._P
        return max(w.lo, spec.first_needed_token(start) // self._P)

    def _sync(self, request: Request, start: int, replay: bool = False) -> None:
        """Reconcile the sliding groups with ``request``'s table after the full group
        changed it, its next step starting at token ``start``: release the blocks the
        window left (kept idle: published, or to be a round late under overlap) and those
        no longer in the table (truncated, or replaced by a copy-on-write), take the
        window's blocks it does not hold yet. A block freshly allocated in the full group
        may still have an idle mapping from the tokens it held before: taking it is
        harmless, as the step writes every position of a fresh block before any window
        reads it (a copy-on-write copies into it first). A ``replay`` starting at ``start``
        takes the blocks from ``start`` on only (the keys before it are never read)."""
        table = request.block_table
        windows = self._windows.get(request.request_id)
        if windows is None:
            windows = self._windows[request.request_id] = [WindowHold() for _ in self._groups]
        index = index_of(self._inner)
        for (_, spec, m), w in zip(self._groups, windows):
            lo = start // self._P if replay else self._new_lo(w, spec, start)
            mine: dict[int, int] = {}
            for j, b in enumerate(w.held, w.lo):
                if lo <= j < len(table) and table[j] == b:
                    mine[j] = b
                else:
                    m.release(b, keep=index is not None and (index.contains(b) or (j < lo and table[j] == b)))
            for j in range(lo, len(table)):
                if mine.get(j) != table[j]:
                    m.acquire(table[j])
            w.lo, w.held = lo, table[lo:]

    # ---------------------------------------------------------------- other changes

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` every block of ``parent`` by reference, in every group."""
        self._inner.fork(parent, child)
        parents = self._windows.get(parent.request_id)
        windows = [WindowHold() for _ in self._groups]
        if parents is not None:
            for (_, _, m), pw, cw in zip(self._groups, parents, windows):
                for b in pw.held:
                    m.acquire(b)
                cw.lo, cw.held = pw.lo, list(pw.held)
        self._windows[child.request_id] = windows

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Release the blocks wholly beyond the first ``num_tokens`` tokens, in every group
        (speculative rollback: the window below stays, within ``backtrack``)."""
        self._inner.truncate(request, num_tokens)
        windows = self._windows.get(request.request_id)
        if windows is None:
            return
        n = len(request.block_table)
        index = index_of(self._inner)
        for (_, _, m), w in zip(self._groups, windows):
            cut = max(0, n - w.lo)
            for b in reversed(w.held[cut:]):
                m.release(b, keep=index is not None and index.contains(b))
            del w.held[cut:]

    def free(self, request: Request) -> None:
        """Release every block of ``request`` in every group (tail first). Idempotent."""
        self._inner.free(request)
        self._replays.pop(request.request_id, None)  # a replay matched and never allocated
        self._marks.forget(request.request_id)
        index = index_of(self._inner)
        for (_, _, m), w in zip(self._groups, self._windows.pop(request.request_id, None) or ()):
            for b in reversed(w.held):
                m.release(b, keep=index is not None and index.contains(b))

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish in the full group (see :meth:`KVCacheManager.cache_full_blocks`); a
        replay's exact windows become matchable once published past."""
        self._inner.cache_full_blocks(request, num_tokens)
        if request.request_id in self._windows:
            self._marks.settle(request.request_id, num_tokens, self._maps, self._windows[request.request_id])

    def reset_prefix_cache(self) -> bool:
        """Evict every cached block of every group when none is referenced; False
        otherwise (nothing changed)."""
        if any(m.num_held for _, _, m in self._groups) or not self._inner.reset_prefix_cache():
            return False
        for _, _, m in self._groups:
            m.clear_idle()
        return True

    def check_integrity(self, requests: Iterable[Request] | None = None) -> None:
        """The full group's checks, then each sliding group's conservation and, when
        ``requests`` lists every request holding blocks, its reference counts.

        Raises:
            InvariantError: naming the group and blocks at fault.
        """
        listed = None if requests is None else list(requests)
        self._inner.check_integrity(listed)
        if listed is None:
            return
        known = {r.request_id for r in listed}
        stray = [rid for rid in self._windows if rid not in known]
        if stray:
            raise InvariantError(f"sliding-window groups hold blocks for requests not listed: {stray[:5]}")
        for k, (_, _, m) in enumerate(self._groups):
            m.check(b for r in listed for b in self._windows.get(r.request_id, [WindowHold()] * len(self._groups))[k].held)


if TYPE_CHECKING:
    _check: type[KVCacheManager] = HybridKVCacheManager
