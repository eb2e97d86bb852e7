"""CompileCache: a bounded, thread-safe LRU of compiled grammars keyed by spec and tokenizer."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

from deepinfer_kit.errors import ConfigError

__all__ = ["CompileCache"]

G = TypeVar("G")


class CompileCache(Generic[G]):
    """Least-recently-used map ``(spec.key(), tokenizer key) -> compiled grammar`` holding at
    most ``capacity`` entries. Every method takes a lock, so compile workers may share it;
    compiling happens outside it (two threads may compile one spec at once, the last put wins).

    Raises:
        ConfigError: ``capacity`` below 1.
    """

    def __init__(self, capacity: int = 256) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(f"capacity must be an int >= 1, got {capacity!r}")
        self.capacity = capacity
        self._entries: OrderedDict[Hashable, G] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable) -> G | None:
        """The entry at ``key`` (now the most recent), or None; counts a hit or a miss."""
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return found

    def put(self, key: Hashable, value: G) -> None:
        """Store ``value`` at ``key`` as the most recent entry, evicting the least recent
        beyond ``capacity``."""
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
