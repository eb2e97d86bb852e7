"""LRUEvictionPolicy: evict the least recently used unreferenced cached block first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

__all__ = ["LRUEvictionPolicy"]


class LRUEvictionPolicy:
    """Least recently used first, on an ``OrderedDict`` (O(1) per block).

    With the indexes' calling conventions (a request's blocks pushed tail first, matched
    chains touched tail first) a chain's tail is always evicted before its head.
    """

    __slots__ = ("_order",)

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        """Tracked blocks."""
        return len(self._order)

    def __contains__(self, block: int) -> bool:
        """True when ``block`` is tracked."""
        return block in self._order

    def push(self, blocks: Sequence[int]) -> None:
        """Track ``blocks`` (none tracked yet) as most recently used (first given is the
        first victim)."""
        self._order.update(dict.fromkeys(blocks))  # C loops: a finished request's blocks

    def discard(self, blocks: Sequence[int]) -> None:
        """Stop tracking ``blocks`` (untracked ones ignored)."""
        pop = self._order.pop
        for b in blocks:
            pop(b, None)

    def touch(self, blocks: Sequence[int]) -> None:
        """Move the tracked ones among ``blocks`` to the most recent end, in order."""
        order = self._order
        move = order.move_to_end
        for b in blocks:
            if b in order:
                move(b)

    def pop(self, n: int) -> list[int]:
        """Remove and return up to ``n`` least recently used blocks."""
        order = self._order
        if n == 1 and order:  # one block per decode that crosses into a new one
            return [order.popitem(last=False)[0]]
        popitem = order.popitem
        return [popitem(last=False)[0] for _ in range(min(n, len(order)))]


if TYPE_CHECKING:
    from deepinfer_kit.cache.protocols import EvictionPolicy

    _check: type[EvictionPolicy] = LRUEvictionPolicy
