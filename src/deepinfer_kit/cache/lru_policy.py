"""LRUEvictionPolicy: evict the least recently used unreferenced cached block first."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

__all__ = ["LRUEvictionPolicy"]


class LRUEvictionPolicy:
    """Least recently used first, in batches with lazy deletion (O(1) amortised per block).

    The index hands the policy whole lists: a finished request's blocks (``push``), a
    match's hits (``touch``), an allocation's cached prefix (``discard``). So the order is
    kept as a queue of *batches*, oldest first, and each tracked block remembers the one
    batch that holds it live (a flat list indexed by block id, ``-1`` when untracked).
    Pushing or touching a list appends one batch and writes one list slot per block;
    discarding writes the slot only. A batch entry whose block now lives in a later batch,
    or is untracked, is stale; ``pop`` skips stale entries from the oldest batch on. Stale
    entries are compacted away once they outnumber the live ones, so memory stays
    O(tracked blocks + largest block id).

    The same order as an ``OrderedDict`` with ``move_to_end``, at about 60% of its cost
    on the prefix-cache benchmark's recorded call sequence (no per-block node is
    allocated, and a touch that the next allocation takes is never applied). With the
    indexes' calling conventions (a request's blocks pushed tail first, matched chains
    touched tail first) a chain's tail is always evicted before its head. Block ids are
    the allocator's: ints >= 0. Not thread-safe (the scheduler owns it).
    """

    __slots__ = ("_where", "_size", "_batches", "_head", "_next_id", "_entries", "_owed")

    def __init__(self) -> None:
        self._where: list[int] = []  # block -> id of the batch holding it live, or -1
        self._size = 0  # tracked blocks
        self._batches: deque[tuple[int, list[int]]] = deque()  # (id, blocks), oldest first
        self._head = 0  # entries of the oldest batch already consumed by pop
        self._next_id = 0
        self._entries = 0  # entries in all batches (live and stale), for compaction
        # The last touch, not applied yet: applied before any other change, or cancelled
        # by a discard of the same blocks (a match's hits taken by the next allocation).
        self._owed: list[int] | None = None

    def __len__(self) -> int:
        """Tracked blocks. O(1)."""
        return self._size

    def __contains__(self, block: int) -> bool:
        """True when ``block`` is tracked. O(1)."""
        return 0 <= block < len(self._where) and self._where[block] >= 0

    def _fit(self, blocks: Sequence[int]) -> list[int]:
        where = self._where
        top = max(blocks)
        if top >= len(where):
            where.extend([-1] * (top + 1 - len(where)))
        return where

    def _append(self, blocks: list[int], new: int) -> None:
        """Queue ``blocks`` as the newest batch (``new`` of them were untracked)."""
        self._size += new
        self._batches.append((self._next_id, blocks))
        self._next_id += 1
        self._entries += len(blocks)
        if self._entries > 2 * self._size + 256:
            self._compact()

    def push(self, blocks: Sequence[int]) -> None:
        """Track ``blocks`` (none tracked yet) as most recently used (first given is the
        first victim). O(len(blocks))."""
        if not blocks:
            return
        if self._owed is not None:
            self._settle()
        where = self._fit(blocks)
        bid = self._next_id
        new = 0
        for b in blocks:
            if where[b] < 0:
                new += 1
            where[b] = bid
        self._append(list(blocks), new)

    def discard(self, blocks: Sequence[int]) -> None:
        """Stop tracking ``blocks`` (untracked ones ignored). Their batch entries become
        stale. O(len(blocks))."""
        owed = self._owed
        if owed is not None:
            self._owed = None
            if len(owed) != len(blocks) or owed[::-1] != list(blocks):
                taken = set(blocks)
                self._touch_now([b for b in owed if b not in taken])
        where = self._where
        size = len(where)
        gone = 0
        for b in blocks:
            if b < size and where[b] >= 0:
                where[b] = -1
                gone += 1
        self._size -= gone

    def touch(self, blocks: Sequence[int]) -> None:
        """Move the tracked ones among ``blocks`` to the most recent end, in order (their
        old entries become stale). O(len(blocks)).

        Deferred: the move is owed until the next ``push``, ``touch``, ``pop`` or
        ``discard``, which applies it first; nothing can observe the order before then.
        A ``discard`` of exactly these blocks (head first, as an allocation takes a
        match's hits) cancels it: touching blocks and then untracking them equals
        untracking them. So a match followed by its allocation costs one pass, not three.
        """
        if self._owed is not None:
            self._settle()
        if blocks:
            self._owed = list(blocks)

    def _settle(self) -> None:
        owed = self._owed
        self._owed = None
        if owed:
            self._touch_now(owed)

    def _touch_now(self, blocks: list[int]) -> None:
        where = self._where
        size = len(where)
        hit = [b for b in blocks if b < size and where[b] >= 0]
        if hit:
            bid = self._next_id
            for b in hit:
                where[b] = bid
            self._append(hit, 0)

    def pop(self, n: int) -> list[int]:
        """Remove and return up to ``n`` least recently used blocks. O(n + stale entries
        skipped)."""
        if n > self._size:
            n = self._size
        out: list[int] = []
        if n <= 0:
            return out
        if self._owed is not None:
            self._settle()
        self._size -= n
        where = self._where
        take = out.append
        batches = self._batches
        i = self._head
        while True:
            bid, blocks = batches[0]
            end = len(blocks)
            while i < end:
                b = blocks[i]
                i += 1
                if where[b] == bid:
                    where[b] = -1
                    take(b)
                    if len(out) == n:
                        if i == end:
                            batches.popleft()
                            self._entries -= end
                            i = 0
                        self._head = i
                        return out
            batches.popleft()
            self._entries -= end
            i = 0

    def _compact(self) -> None:
        """Drop stale entries and emptied batches (order unchanged). O(entries)."""
        where = self._where
        kept: deque[tuple[int, list[int]]] = deque()
        head = self._head
        for bid, blocks in self._batches:
            live = [b for b in (blocks[head:] if head else blocks) if where[b] == bid]
            head = 0
            if live:
                kept.append((bid, live))
        self._batches = kept
        self._head = 0
        self._entries = sum(len(blocks) for _, blocks in kept)


if TYPE_CHECKING:
    from deepinfer_kit.cache.protocols import EvictionPolicy

    _check: type[EvictionPolicy] = LRUEvictionPolicy
