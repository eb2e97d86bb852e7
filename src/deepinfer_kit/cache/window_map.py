"""WindowBlockMap: one sliding-window group's blocks, each standing for the full-group block
whose tokens it holds.

A sliding group keeps the K/V of a token block only while some sequence's window still
reads it. Its blocks come from a pool of their own (one :class:`FreeListBlockAllocator`);
the map says which of them holds the sliding layers' K/V of full-group block ``b``. Two
sequences sharing ``b`` (a prefix hit, a fork) share its sliding block too: the same
tokens after the same prefix give the same K/V. A block no window reads any more is freed,
or kept *idle* (evictable, least recently released first) when ``b`` is published in the
prefix index, so a later prefix hit ending after ``b`` finds the window it needs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

import attrs

from deepinfer_kit.cache.free_list_allocator import FreeListBlockAllocator
from deepinfer_kit.errors import InvariantError, OutOfBlocksError

if TYPE_CHECKING:
    from deepinfer_kit.cache.protocols import KVCacheManager, PrefixIndex

__all__ = ["WindowBlockMap", "WindowHold", "index_of", "replay_start_of"]


class WindowBlockMap:
    """The blocks of one sliding group, keyed by the full-group block they stand for.

    Mutated only by :class:`~deepinfer_kit.cache.hybrid_manager.HybridKVCacheManager`.
    The device copy of the map is updated from :meth:`drain_updates` (the pairs set since
    the last drain) before the forward that first writes into a newly mapped block.

    Args:
        num_blocks: blocks in the group's pool.
        block_size: tokens per block (the full group's).

    Raises:
        ConfigError: ``num_blocks`` or ``block_size`` below 1.
    """

    __slots__ = ("_allocator", "_own", "_idle", "_updates", "_inexact")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self._allocator = FreeListBlockAllocator(num_blocks, block_size)
        self._own: dict[int, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()
        self._updates: list[tuple[int, int]] = []
        self._inexact: set[int] = set()

    @property
    def num_blocks(self) -> int:
        """Blocks in the group's pool."""
        return self._allocator.num_blocks

    @property
    def num_available(self) -> int:
        """Free plus idle (evictable) blocks. O(1)."""
        return self._allocator.num_free + len(self._idle)

    @property
    def num_held(self) -> int:
        """Blocks some sequence's window reads."""
        return self._allocator.num_blocks - self.num_available

    def cached(self, full: int) -> bool:
        """True when ``full``'s block holds K/V a prefix hit may read: mapped, and not
        written by a bounded replay's inexact start (:meth:`mark_inexact`)."""
        return full in self._own and full not in self._inexact

    def mark_inexact(self, full: int) -> None:
        """``full``'s block (held) holds K/V a bounded replay computed without the keys
        before it: only that replay reads it; it is never matched, nor kept idle."""
        self._inexact.add(full)

    def mark_exact(self, full: int) -> None:
        """``full``'s block (held), marked inexact while a replay's round was in flight,
        now holds exact K/V: prefix hits may read it."""
        self._inexact.discard(full)

    def lookup(self, full: int) -> int | None:
        """The group's block standing for full-group block ``full``, or ``None``."""
        return self._own.get(full)

    def holders(self, full: int) -> int:
        """Windows reading ``full``'s block (0 when unmapped or idle)."""
        own = self._own.get(full)
        return 0 if own is None else self._allocator.ref_count(own)

    def acquire(self, full: int) -> None:
        """One more window reads ``full``'s block: take a reference to its mapped block
        (waking it if idle), or map a fresh block (evicting the least recently released
        idle one when none is free). O(1).

        Raises:
            OutOfBlocksError: ``full`` is unmapped and no block is free or idle; nothing
                changes.
        """
        own = self._own.get(full)
        if own is not None:
            self._idle.pop(full, None)
            self._allocator.retain((own,))
            return
        if self._allocator.num_free == 0:
            if not self._idle:
                raise OutOfBlocksError("sliding-window group: no free or idle block")
            self.evict(1)
        (own,) = self._allocator.allocate(1)
        self._own[full] = own
        self._updates.append((full, own))

    def release(self, full: int, *, keep: bool) -> None:
        """One window stops reading ``full``'s block. When none reads it any more it
        becomes idle (``keep``: ``full`` is published, a prefix hit may want it back) or
        is freed and unmapped. O(1).

        Raises:
            InvariantError: ``full`` is unmapped or unreferenced.
        """
        own = self._own.get(full)
        if own is None or full in self._idle:
            raise InvariantError(f"sliding-window group: release of unheld block {full}")
        if self._allocator.release((own,)):
            if full in self._inexact:
                self._inexact.discard(full)
                keep = False
            if keep:
                self._idle[full] = None
            else:
                self._allocator.free((own,))
                del self._own[full]

    def forget_idle(self, fulls: Iterable[int]) -> None:
        """Unmap the idle blocks of ``fulls``: full-group blocks just allocated afresh,
        whose old mapping holds K/V of the tokens they held before. (A window that will
        write the block would overwrite it anyway; one that never will, a block loaded
        from a KV tier before a replay's start, must not be matched with it.) O(len)."""
        for full in fulls:
            if full in self._idle:
                del self._idle[full]
                self._allocator.free((self._own.pop(full),))
                self._inexact.discard(full)

    def evict(self, n: int) -> list[int]:
        """Free the ``n`` least recently released idle blocks; returns the full-group
        blocks they stood for."""
        gone: list[int] = []
        while len(gone) < n and self._idle:
            full, _ = self._idle.popitem(last=False)
            self._allocator.free((self._own.pop(full),))
            gone.append(full)
        return gone

    def clear_idle(self) -> None:
        """Free every idle block (a prefix-cache reset)."""
        self.evict(len(self._idle))

    def drain_updates(self) -> list[tuple[int, int]]:
        """``(full, own)`` pairs mapped since the last drain, in order; clears them."""
        out, self._updates = self._updates, []
        return out

    def check(self, holders: Iterable[int]) -> None:
        """Conservation and reference counts: ``holders`` lists, once per window reading
        it, every full-group block some sequence holds in this group.

        Raises:
            InvariantError: naming the blocks at fault.
        """
        alloc = self._allocator
        counts: dict[int, int] = {}
        for full in holders:
            counts[full] = counts.get(full, 0) + 1
        wrong = {f: (self.holders(f), c) for f, c in counts.items() if self.holders(f) != c}
        held = sum(1 for f in self._own if f not in self._idle)
        if wrong or held != len(counts):
            raise InvariantError(
                f"sliding-window group: reference counts differ from windows (block: (count, "
                f"holders)): {dict(sorted(wrong.items())[:20])}; {held} mapped blocks held, "
                f"{len(counts)} read")
        if alloc.num_free + len(self._own) != alloc.num_blocks:
            raise InvariantError(
                f"sliding-window group: conservation broken: free {alloc.num_free} + mapped "
                f"{len(self._own)} != {alloc.num_blocks}")


def replay_start_of(full: int, kept: int, blocks: list[int], bound: int, limit: int, block_size: int,
                    maps: list[WindowBlockMap]) -> int | None:
    """Where a bounded replay serving a prefix hit of ``full`` tokens (full-group blocks
    ``blocks``) must start, or ``None`` when none should run: the windows already give a
    hit of ``kept`` tokens at least as long, the replay (``full - bound`` rounded down to a
    block) would exceed ``limit`` tokens, or a sliding group still maps a block the replay
    would write (its K/V is another sequence's, or a cached window's: never overwritten)."""
    if not limit or kept >= full:
        return None
    start = max(0, full - bound) // block_size * block_size
    if start <= kept or full - start > limit:
        return None
    if any(m.lookup(b) is not None for m in maps for b in blocks[start // block_size:full // block_size]):
        return None
    return start


@attrs.define(slots=True)
class WindowHold:
    """The full-group blocks one sequence holds in one sliding group: logical blocks
    ``lo, lo + 1, ...`` of its table, by their full-group ids."""

    lo: int = 0
    held: list[int] = attrs.field(factory=list)


def index_of(manager: KVCacheManager) -> PrefixIndex | None:
    """The manager's prefix index when it exposes one (``BlockKVCacheManager.index``)."""
    index = getattr(manager, "index", None)
    return index if index is not None and hasattr(index, "contains") else None
