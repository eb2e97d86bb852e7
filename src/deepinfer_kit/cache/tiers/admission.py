"""Admission to the tiers: which blocks may go down at all."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

__all__ = ["SeenTwice"]


class SeenTwice:
    """Admit a key the second time it is offered (or observed) within the last ``window``
    distinct keys seen; the first time only remembers it. Keeps one-off prompts out of
    the tiers (a block computed once and never reused costs a copy and a slot for
    nothing). O(1) per key; memory ``window`` keys."""

    __slots__ = ("_seen", "_window")

    def __init__(self, window: int) -> None:
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._window = window

    def observe(self, keys: Iterable[bytes]) -> None:
        """Count a sighting of each key (a device hit) without deciding anything."""
        for key in keys:
            self._see(key)

    def admit(self, key: bytes) -> bool:
        """True when ``key`` was seen before; records the sighting either way."""
        return self._see(key)

    def _see(self, key: bytes) -> bool:
        seen = self._seen
        if key in seen:
            seen.move_to_end(key)
            return True
        seen[key] = None
        if len(seen) > self._window:
            seen.popitem(last=False)
        return False
