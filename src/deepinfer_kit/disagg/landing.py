"""LandingSlots: device memory a KV link receives blocks into, keyed by block identity,
until the decode engine's loads copy them into its pool (device to device)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch

from deepinfer_kit.cache.hybrid_kv import KVStorage
from deepinfer_kit.errors import CapacityError, ConfigError, InvariantError

__all__ = ["LandingSlots"]


class LandingSlots:
    """``num_slots`` blocks of ``kv``'s shape (``kv.block_shape``: every model layer) on
    ``kv``'s device: where the decode side of a device link receives the prefill side's
    blocks, and what its loads read.

    A received block (:meth:`put`, on the link's receiving thread) becomes readable once
    its bytes are in place (on CUDA its copy is synchronised first); the scheduler side
    then counts (:meth:`ready`, waiting up to a deadline), pins (:meth:`pin`) and unpins
    slots. Room for a new block is taken from a free slot, else from the least recently
    received or read block no load pins; when every slot is pinned the block is dropped
    (``dropped``: the decode engine recomputes it). A key received twice is kept once.

    Args:
        kv: the decode engine's K/V (its device, dtype and block shape).
        num_slots: blocks (>= 1).
        fingerprint: what the blocks mean (model, block shape, dtype:
            ``cache.tiers.disk_store.layout_fingerprint``); the link drops a block sent
            with another.

    Raises:
        ConfigError: ``num_slots`` not an int >= 1.
        CapacityError: the device cannot hold the slots (names their count and shape).
    """

    def __init__(self, kv: KVStorage, num_slots: int, fingerprint: bytes) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ConfigError(f"landing slots must be an int >= 1, got num_slots={num_slots!r}")
        shape = (num_slots, *kv.block_shape)
        try:
            self.slab = torch.zeros(shape, dtype=kv.dtype, device=kv.device)
        except (RuntimeError, MemoryError) as exc:
            raise CapacityError(f"num_slots={num_slots} landing slots {shape} do not fit on {kv.device}: "
                                f"{exc}") from exc
        self.fingerprint = fingerprint
        cuda = kv.device.type == "cuda"
        self._stream = torch.cuda.Stream(kv.device) if cuda else None  # type: ignore[no-untyped-call]
        self._cv = threading.Condition()
        self._ready: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recent first
        self._free = list(range(num_slots - 1, -1, -1))
        self._pins: dict[int, int] = {}  # slot -> loads holding it
        self._stored: list[bytes] = []  # keys received since take_changes
        self._removed: list[bytes] = []
        self._gone: OrderedDict[bytes, None] = OrderedDict()  # keys evicted or dropped (bounded)
        self.received = 0
        self._open: set[int] = {0}  # the senders still delivering (source numbers)
        self.waits = 0  # ready() calls that waited for a block to land
        self.dropped = 0  # blocks that found every slot pinned
        self.evicted = 0

    @property
    def num_slots(self) -> int:
        """How many blocks the slots hold."""
        return int(self.slab.shape[0])

    def put(self, key: bytes, payload: torch.Tensor) -> None:
        """Receive ``key``'s bytes (``payload``: the block, or its bytes flat as uint8, on
        any device): :meth:`put_many` of one.

        Raises:
            InvariantError: ``payload`` is not one block's bytes.
        """
        self.put_many([key], payload.contiguous().view(torch.uint8).reshape(1, -1))

    def put_many(self, keys: Sequence[bytes], payload: torch.Tensor) -> None:
        """Receive the blocks ``keys`` (``payload``: ``[len(keys), block bytes]`` uint8, on
        any device, in that order) with one copy (on CUDA, one synchronisation). Called on
        the link's receiving thread; blocks only for the copy. A key here already is kept
        (its first bytes); one that finds every slot pinned is dropped.

        Raises:
            InvariantError: ``payload`` is not ``len(keys)`` blocks' bytes.
        """
        per = self.slab[0].numel() * self.slab.element_size()
        rows = payload.contiguous().view(torch.uint8).reshape(len(keys), -1) if keys else payload
        if not keys or rows.shape[1] != per:
            if keys:
                raise InvariantError(f"received blocks of {rows.shape[1]} bytes; a slot holds {per}")
            return
        taken: list[tuple[int, int, bytes]] = []  # (row, slot, key)
        with self._cv:
            for row, key in enumerate(keys):
                if key in self._ready or any(k == key for _, _, k in taken):
                    if key in self._ready:
                        self._ready.move_to_end(key)
                    continue
                slot = self._claim()  # in neither the free list nor the ready map while it lands
                if slot is None:
                    self.dropped += 1
                    self._lost(key)
                    continue
                taken.append((row, slot, key))
        if not taken:
            return
        try:
            self._copy([s for _, s, _ in taken], rows, [r for r, _, _ in taken])
        except BaseException:
            with self._cv:
                self._free.extend(s for _, s, _ in taken)
            raise
        with self._cv:
            for _, slot, key in taken:
                self._ready[key] = slot
                self._gone.pop(key, None)
                self._stored.append(key)
            self.received += len(taken)
            self._cv.notify_all()

    def _copy(self, slots: list[int], rows: torch.Tensor, picked: list[int]) -> None:
        """Copy ``rows[picked]`` into ``slots`` and return when they are there: on CUDA on
        a stream of the slots' own (the runner's forward never waits for it), synchronised;
        a peer copy from another GPU also waits for that GPU's side."""
        flat = self.slab.view(self.num_slots, -1).view(torch.uint8)
        src = rows if len(picked) == rows.shape[0] else rows[picked]
        index = torch.tensor(slots, dtype=torch.int64, device=self.slab.device)
        if self._stream is None:
            flat.index_copy_(0, index, src.to(self.slab.device))
            return
        with torch.cuda.stream(self._stream):
            flat.index_copy_(0, index, src.to(self.slab.device, non_blocking=False))
        self._stream.synchronize()
        if rows.device.type == "cuda" and rows.device != self.slab.device:
            torch.cuda.current_stream(rows.device).synchronize()

    def _claim(self) -> int | None:
        """A slot for a new block (under the lock): a free one, else the least recent
        unpinned block's (forgotten); None when every slot is pinned."""
        if self._free:
            return self._free.pop()
        for key, slot in self._ready.items():
            if slot not in self._pins:
                del self._ready[key]
                self._removed.append(key)
                self._lost(key)
                self.evicted += 1
                return slot
        return None

    def _lost(self, key: bytes) -> None:
        """Remember (under the lock, a bounded number) that ``key`` came and is gone: a
        reader waiting for it would wait for nothing."""
        self._gone[key] = None
        if len(self._gone) > max(4 * self.num_slots, 1 << 14):
            self._gone.popitem(last=False)

    @property
    def closed(self) -> bool:
        """True once every sender's link ended (:meth:`close`): nothing more lands."""
        return not self._open

    def open_sources(self, sources: Sequence[int]) -> None:
        """The senders this slots' links receive from (default: one, source 0). Called
        before any receiver starts."""
        with self._cv:
            self._open = set(sources)

    def ready(self, keys: Sequence[bytes], wait_for: int = 0, deadline: float | None = None) -> int:
        """How many of ``keys``, from the first, are here. While fewer than ``wait_for``
        are, ``time.monotonic()`` is before ``deadline``, the link still delivers (not
        :meth:`close`-d) and the next key has not landed and gone already (evicted for
        room, or dropped: it will not come again), waits for more to land (``waits``
        counts the calls that did).
        Called on the scheduler's thread."""
        with self._cv:
            return self._count(keys, wait_for, deadline, None)

    def take(self, keys: Sequence[bytes], wait_for: int = 0, deadline: float | None = None,
             source: int | None = None) -> list[int]:
        """:meth:`ready`, and the slots of the keys found, pinned in the same hold of the
        lock (a block landing meanwhile cannot evict one of them in between), made the most
        recent. Release them with :meth:`unpin`. ``source``: the sender the blocks come
        from; once its link ended, no wait."""
        with self._cv:
            return self._pin(keys[:self._count(keys, wait_for, deadline, source)])

    def _count(self, keys: Sequence[bytes], wait_for: int, deadline: float | None, source: int | None) -> int:
        """:meth:`ready` under the lock (waiting releases it)."""
        waited = False
        while True:
            n = 0
            for key in keys:
                if key not in self._ready:
                    break
                n += 1
            ended = not self._open or (source is not None and source not in self._open)
            if n >= min(wait_for, len(keys)) or deadline is None or ended or keys[n] in self._gone:
                return n  # enough; no wait asked; nothing more lands; or the next one came and went
            left = deadline - time.monotonic()
            if left <= 0:
                return n
            if not waited:
                self.waits += 1
                waited = True
            self._cv.wait(left)

    def close(self, source: int = 0) -> None:
        """Nothing more will land from ``source`` (its link ended or failed; called by its
        receiver): waits for its blocks stop, now and later, and all waits once every
        source is closed. The blocks here stay readable."""
        with self._cv:
            self._open.discard(source)
            self._cv.notify_all()

    def pin(self, keys: Sequence[bytes]) -> list[int]:
        """The slots of ``keys`` (all here: see :meth:`ready`), held until :meth:`unpin`
        (never overwritten meanwhile), and made the most recent.

        Raises:
            InvariantError: a key not here.
        """
        with self._cv:
            return self._pin(keys)

    def _pin(self, keys: Sequence[bytes]) -> list[int]:
        """:meth:`pin` under the lock."""
        slots = []
        for key in keys:
            slot = self._ready.get(key)
            if slot is None:
                raise InvariantError(f"landing key {key.hex()} pinned but not here")
            self._ready.move_to_end(key)
            self._pins[slot] = self._pins.get(slot, 0) + 1
            slots.append(slot)
        return slots

    def unpin(self, slots: Sequence[int]) -> None:
        """Release one hold of each of ``slots`` (from :meth:`pin`)."""
        with self._cv:
            for slot in slots:
                left = self._pins.get(slot, 0) - 1
                if left < 0:
                    raise InvariantError(f"landing slot {slot} unpinned more than pinned")
                if left:
                    self._pins[slot] = left
                else:
                    del self._pins[slot]

    def take_changes(self) -> tuple[list[bytes], list[bytes]]:
        """``(stored, removed)`` keys since the last call (the connector's KV events)."""
        with self._cv:
            out = (self._stored, self._removed)
            self._stored, self._removed = [], []
            return out

    def clear(self) -> None:
        """Forget every block no load pins (``reset_prefix_cache``)."""
        with self._cv:
            for key, slot in list(self._ready.items()):
                if slot not in self._pins:
                    del self._ready[key]
                    self._removed.append(key)
                    self._lost(key)
                    self._free.append(slot)

    def check_idle(self) -> None:
        """With no request live: no slot pinned.

        Raises:
            InvariantError: naming the pinned slots.
        """
        with self._cv:
            if self._pins:
                raise InvariantError(f"landing slots still pinned with no request live: {sorted(self._pins)}")
