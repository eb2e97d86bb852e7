"""KVEventFeed: a server's KV events (blocks stored in and removed from the device, host
and disk tiers) as a numbered feed that any number of routers read by cursor
(``GET /v1/kv_events?after=N``)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from deepinfer_kit.cache.tiers.records import KVEvent

__all__ = ["KVEventFeed"]


class KVEventFeed:
    """Events numbered from 1 in the order the engine reported them; the last ``limit``
    are kept. A reader passes the last number it saw and gets what came after, the newest
    number, and whether events it never saw were dropped (``lost``: it read too rarely;
    it should then forget what it knew of this server and rebuild from what follows).
    Used on the server's event loop only."""

    def __init__(self, limit: int = 1 << 16) -> None:
        self._events: deque[tuple[int, KVEvent]] = deque(maxlen=limit)
        self._last = 0

    def extend(self, events: Iterable[KVEvent]) -> None:
        """Append the engine's newest events (``TieredKVCacheManager.take_kv_events``)."""
        for ev in events:
            self._last += 1
            self._events.append((self._last, ev))

    def since(self, after: int) -> dict[str, Any]:
        """``{"events": [{"seq", "kind", "medium", "keys": [hex, ...]}], "last": newest
        number, "lost": bool}`` for the events after ``after``. O(events returned)."""
        first = self._events[0][0] if self._events else self._last + 1
        lost = after < first - 1
        events = [{"seq": seq, "kind": ev.kind, "medium": ev.medium, "keys": [k.hex() for k in ev.keys]}
                  for seq, ev in self._events if seq > after]
        return {"events": events, "last": self._last, "lost": lost}
