"""FrequencyEvictionPolicy: evict the least frequently used block first (ties: least
recently used), with counts halved periodically so old popularity fades."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import TYPE_CHECKING

__all__ = ["FrequencyEvictionPolicy"]


class FrequencyEvictionPolicy:
    """An :class:`~deepinfer_kit.cache.protocols.EvictionPolicy` that keeps what is used
    often: a block's count grows by one at each :meth:`push` and :meth:`touch`; the victim
    is the tracked block with the smallest count, the least recently used among equals.
    Every ``period`` uses all counts are halved (aging), so a block hot an hour ago does not
    stay forever. A count survives :meth:`discard` (a block in use again keeps its history)
    and is forgotten by :meth:`pop` (the slot will hold something else).

    Against LRU it protects a shared prefix (a system prompt hit by many requests) from a
    burst of one-off prompts that would each push it one place toward eviction.

    Heap with lazy deletion: O(log n) per tracked change, O(n) per aging pass (amortised
    O(1) per use with ``period >= n``). Not thread-safe (the scheduler owns it).

    Args:
        period: uses between agings; ``None``: twice the tracked blocks, at least 1024.
    """

    __slots__ = ("_count", "_stamp", "_tracked", "_heap", "_tick", "_uses", "_period")

    def __init__(self, period: int | None = None) -> None:
        self._count: dict[int, int] = {}
        self._stamp: dict[int, int] = {}  # block -> tick of its live heap entry
        self._tracked: set[int] = set()
        self._heap: list[tuple[int, int, int]] = []  # (count, tick, block)
        self._tick = 0
        self._uses = 0
        self._period = period

    def __len__(self) -> int:
        return len(self._tracked)

    def count(self, block: int) -> int:
        """The block's current (aged) use count; 0 when unknown. O(1)."""
        return self._count.get(block, 0)

    def _use(self, block: int) -> None:
        self._count[block] = self._count.get(block, 0) + 1
        self._uses += 1

    def _enter(self, block: int) -> None:
        self._tick += 1
        self._stamp[block] = self._tick
        heapq.heappush(self._heap, (self._count[block], self._tick, block))

    def push(self, blocks: Sequence[int]) -> None:
        """Track ``blocks`` (one use each); among equal counts the first given goes first."""
        for b in blocks:
            self._use(b)
            self._tracked.add(b)
            self._enter(b)
        self._maybe_age()

    def discard(self, blocks: Sequence[int]) -> None:
        """Stop tracking ``blocks`` (their counts are kept); untracked ones are ignored."""
        for b in blocks:
            if b in self._tracked:
                self._tracked.discard(b)
                self._stamp.pop(b, None)

    def touch(self, blocks: Sequence[int]) -> None:
        """One use for each tracked block among ``blocks``; untracked ones are ignored."""
        for b in blocks:
            if b in self._tracked:
                self._use(b)
                self._enter(b)
        self._maybe_age()

    def pop(self, n: int) -> list[int]:
        """Stop tracking and return up to ``n`` victims (fewest uses, then oldest), first
        victim first; their counts are forgotten."""
        out: list[int] = []
        heap, stamp = self._heap, self._stamp
        while heap and len(out) < n:
            _, tick, b = heapq.heappop(heap)
            if stamp.get(b) != tick:
                continue  # stale: used again since, discarded, or popped
            del stamp[b]
            self._tracked.discard(b)
            self._count.pop(b, None)
            out.append(b)
        return out

    def _maybe_age(self) -> None:
        period = self._period if self._period is not None else max(1024, 2 * len(self._tracked))
        if self._uses >= period:
            self._uses = 0
            for b in self._count:
                self._count[b] >>= 1
        elif len(self._heap) <= 4 * len(self._stamp) + 1024:
            return  # stale entries are few: keep the heap
        # Rebuild the heap with the halved counts, keeping the recency order.
        self._heap = [(self._count[b], t, b) for b, t in self._stamp.items()]
        heapq.heapify(self._heap)


if TYPE_CHECKING:
    from deepinfer_kit.cache.protocols import EvictionPolicy

    _check: type[EvictionPolicy] = FrequencyEvictionPolicy
