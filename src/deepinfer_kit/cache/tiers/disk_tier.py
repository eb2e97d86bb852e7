"""DiskTier: the scheduler side's disk tier — which keys are on disk, their I/O in
threads, reads waited for with a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

from deepinfer_kit.cache.tiers.bytes import BlockStore, InlineExecutor
from deepinfer_kit.cache.tiers.slots import TierSlots, eviction_policy

__all__ = ["DiskTier", "ReadResult", "MISSING"]

ReadResult = Any  # the block's bytes (a tensor; the simulator's: None), or MISSING
MISSING = object()  # a read that found no good block
_POLL_S = 0.001  # how often a read waiting for another engine's write looks again


class DiskTier:
    """``capacity`` blocks on disk, as files of a :class:`BlockStore`
    (:class:`~deepinfer_kit.cache.tiers.disk_store.DiskBlockStore`), each read or written
    in one of ``io_threads`` threads (0: in the caller's thread, the simulator's).

    A key counts as on disk from the moment its write is submitted: a read of it waits
    for that write first, so whether a later request finds a block does not depend on
    how fast the disk is. A write that fails, or a file found damaged when read, drops
    the key (the block is recomputed when next needed). Eviction deletes the file.

    Args:
        store: the files.
        capacity: blocks (>= 1).
        policy: ``"lru"`` or ``"frequency"``.
        io_threads: I/O threads.
        new_block: an empty block buffer for a read to fill (``HostBytes.new_block``).
    """

    def __init__(self, store: BlockStore, capacity: int, policy: str, io_threads: int,
                 new_block: Callable[[], Any]) -> None:
        self.store = store
        self.slots = TierSlots(capacity, eviction_policy(policy))
        self._io: Executor = (ThreadPoolExecutor(io_threads, thread_name_prefix="kv-disk") if io_threads
                              else InlineExecutor())
        self._writes: dict[int, tuple[bytes, Future[None]]] = {}  # slot -> pending write
        self._new_block = new_block

    def has(self, key: bytes) -> bool:
        """True when ``key`` is on disk or being written there."""
        return self.slots.slot(key) is not None

    def is_writing(self, key: bytes) -> bool:
        """True while ``key``'s write is submitted and not yet settled by :meth:`poll_writes`."""
        return self.has(key) and not self.slots.holds(key)

    def write(self, key: bytes, payload: Any) -> bytes | None | bool:
        """Start writing ``payload`` (a tensor the caller no longer touches) as ``key``.

        Returns the key evicted for room (its file is deleted), None when a slot was
        free, or False when every slot is busy (nothing written). A key already on disk
        is only touched (returns None).
        """
        slot = self.slots.slot(key)
        if slot is not None:
            if self.slots.is_ready(slot):
                self.slots.touch(slot)
            return None
        taken = self._claim(key)
        if taken is None:
            return False
        slot, evicted = taken
        self._writes[slot] = (key, self._io.submit(self.store.put, key, payload))
        return evicted

    def _claim(self, key: bytes) -> tuple[int, bytes | None] | None:
        """A slot for ``key`` (pending), deleting the file of the key evicted for it; None
        when every slot is busy."""
        taken = self.slots.take(key)
        if taken is not None and taken[1] is not None:
            self._io.submit(self.store.delete, taken[1])
        return taken

    def poll_writes(self) -> tuple[list[bytes], list[bytes]]:
        """Settle the writes that finished: ``(written, failed)`` keys. A failed write's
        key is dropped. Non-blocking."""
        written: list[bytes] = []
        failed: list[bytes] = []
        for slot, (key, fut) in list(self._writes.items()):
            if not fut.done():
                continue
            del self._writes[slot]
            if self.slots.key(slot) != key:
                continue  # dropped meanwhile
            if fut.exception() is not None:
                self.slots.drop(slot)
                failed.append(key)
            else:
                self.slots.mark_ready(slot)
                written.append(key)
        return written, failed

    def read(self, key: bytes, *, deadline: float | None = None) -> Future[ReadResult]:
        """Start reading ``key`` into a fresh block buffer. With ``deadline``
        (``time.monotonic()`` seconds) a missing file is looked for again until then
        (another engine may be writing it); else a missing file reads as None at once.
        A read of a key being written here waits for that write."""
        slot = self.slots.slot(key)
        pending = self._writes.get(slot) if slot is not None else None
        before = pending[1] if pending is not None and pending[0] == key else None
        return self._io.submit(self._read, key, before, deadline)

    def _read(self, key: bytes, before: Future[None] | None, deadline: float | None) -> ReadResult:
        if before is not None:
            try:
                before.result()
            except Exception:
                return MISSING
        out = self._new_block()
        while True:
            if self.store.get_into(key, out):
                return out
            if deadline is None or time.monotonic() >= deadline:
                return MISSING
            time.sleep(_POLL_S)

    def drop(self, key: bytes) -> None:
        """Forget ``key`` (found damaged or missing); its file is deleted."""
        slot = self.slots.slot(key)
        if slot is not None:
            self.slots.drop(slot)
            self._writes.pop(slot, None)
        self._io.submit(self.store.delete, key)

    def adopt(self, key: bytes) -> bytes | None | bool:
        """Record ``key`` as on disk when another engine wrote its file (read it just
        now). Returns what :meth:`write` returns."""
        if self.slots.slot(key) is not None:
            return None
        taken = self._claim(key)
        if taken is None:
            return False
        self.slots.mark_ready(taken[0])
        return taken[1]

    def clear(self) -> None:
        """Forget every key and delete their files before returning (pending writes finish first)."""
        self.drain()
        self._writes.clear()
        for slot in range(self.slots.capacity):
            key = self.slots.key(slot)
            if key is not None:
                self.slots.drop(slot)
                self.store.delete(key)  # here, not queued: gone when reset returns

    def drain(self) -> None:
        """Wait for every pending write (settle them with :meth:`poll_writes`)."""
        for _, fut in list(self._writes.values()):
            try:
                fut.result()
            except Exception:
                pass

    def close(self) -> None:
        """Stop the I/O threads after the queued work."""
        self._io.shutdown(wait=True)
