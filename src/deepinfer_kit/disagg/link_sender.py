"""Block senders of a device link: a thread sending blocks over torch.distributed in the
order they were submitted, and a loopback into landing slots in the same process."""

from __future__ import annotations

import queue
import threading
from typing import TYPE_CHECKING, Any, Protocol

import torch

from deepinfer_kit.disagg.link import MSG_BLOCK, send_message

if TYPE_CHECKING:
    from deepinfer_kit.disagg.landing import LandingSlots

__all__ = ["BlockSender", "LinkSender", "LoopbackSender"]


class BlockSender(Protocol):
    """Sends blocks the scheduler side of a device link hands it, each named by a token
    the caller chose (a send slot); called on the scheduler's thread."""

    def submit(self, key: bytes, body: torch.Tensor, token: int) -> None:
        """Send ``body`` (one block, on the pool's device; not written until ``token`` is
        reported finished) as ``key``."""
        ...

    def finished(self) -> list[tuple[int, bool]]:
        """``(token, sent)`` of the sends that ended since the last call, in order."""
        ...

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted send ended; False at ``timeout`` seconds first."""
        ...

    def close(self) -> None:
        """End the sends after the queued ones (the engine's close)."""
        ...

    @property
    def broken(self) -> bool:
        """True once no later send can succeed (the channel failed)."""
        ...


class LinkSender:
    """A :class:`BlockSender` over a link end: a thread sends each block to ``peer`` (its
    header over ``group``, gloo; its bytes over ``data_group`` when given, NCCL between
    GPUs, else over ``group`` from host memory), tagged with ``fingerprint`` so the
    receiver drops a block of another model or layout. Sends keep submission order and
    share ``lock`` with :func:`~deepinfer_kit.disagg.link.send_request`, so a request sent
    after its blocks' sends ended (:meth:`drain`) arrives after them. Blocks queued
    together (up to ``batch_blocks``) go as one message: one header and one body, whose
    bytes are stacked first (on the device: one device copy).

    A send that raises, or is not out within ``timeout_s`` (a peer that stopped
    receiving), fails; so does every later one (``error`` holds the first failure: the
    channel is broken and the peer recomputes what never came). So a stuck decode side holds
    the prefill side up for a bounded time (each of a message's three parts has the
    timeout), never for good.
    """

    def __init__(self, fingerprint: bytes, peer: int, group: Any = None, *, data_group: Any = None,
                 timeout_s: float | None = 30.0, batch_blocks: int = 256) -> None:
        self.fingerprint = fingerprint
        self.timeout_s = timeout_s
        self.batch_blocks = batch_blocks
        self._closing = False
        self.peer = peer
        self.group = group
        self.data_group = data_group
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self._queue: queue.SimpleQueue[tuple[bytes, torch.Tensor, int] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple[int, bool]] = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._pending = 0
        self._thread = threading.Thread(target=self._loop, name="kv-link-send", daemon=True)
        self._thread.start()

    @property
    def broken(self) -> bool:
        """True after a send failed: every later one fails too."""
        return self.error is not None

    def submit(self, key: bytes, body: torch.Tensor, token: int) -> None:
        """Queue one block's send (see :class:`BlockSender`)."""
        with self._cv:
            self._pending += 1
        self._queue.put((key, body, token))

    def finished(self) -> list[tuple[int, bool]]:
        """The sends that ended since the last call."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for every queued send to end."""
        with self._cv:
            return self._cv.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        """Send what is queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while True:
            batch = self._take()
            if not batch:
                return
            ok = False
            if self.error is None:
                try:
                    keys = b"".join(k for k, _, _ in batch)
                    body = batch[0][1] if len(batch) == 1 else torch.stack([b for _, b, _ in batch])
                    with self.lock:
                        send_message(MSG_BLOCK, self.fingerprint + keys, body, self.peer, self.group,
                                     self.data_group, self.timeout_s, count=len(batch))
                    ok = True
                except BaseException as exc:  # noqa: BLE001 - reported as failed sends; the peer recomputes
                    self.error = exc
            for _, _, token in batch:
                self._done.put((token, ok))
            with self._cv:
                self._pending -= len(batch)
                self._cv.notify_all()
            if self._closing:
                return

    def _take(self) -> list[tuple[bytes, torch.Tensor, int]]:
        """The next sends, in order: one waited for, then those already queued (up to
        ``batch_blocks``), sent as one message. Empty at the close (after what was queued)."""
        batch: list[tuple[bytes, torch.Tensor, int]] = []
        item = self._queue.get()
        while item is not None:
            batch.append(item)
            if len(batch) >= self.batch_blocks:
                break
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
        else:
            self._closing = True
        return batch


class LoopbackSender:
    """A :class:`BlockSender` into ``landing`` in this process (a prefill and a decode
    side over one device, and the conformance suite's round trip): the blocks submitted
    land together, with one copy, when :meth:`finished` or :meth:`drain` is next called."""

    broken = False  # a copy in this process cannot fail but by raising

    def __init__(self, landing: LandingSlots) -> None:
        self.landing = landing
        self._queued: list[tuple[bytes, torch.Tensor, int]] = []
        self._done: list[tuple[int, bool]] = []

    def submit(self, key: bytes, body: torch.Tensor, token: int) -> None:
        """Queue ``body`` for the next landing (the caller leaves it untouched till then)."""
        self._queued.append((key, body, token))

    def _land(self) -> list[tuple[int, bool]]:
        queued, self._queued = self._queued, []
        if queued:
            rows = torch.stack([b.contiguous().view(torch.uint8).reshape(-1) for _, b, _ in queued])
            self.landing.put_many([k for k, _, _ in queued], rows)
        return [(t, True) for _, _, t in queued]

    def finished(self) -> list[tuple[int, bool]]:
        """Land what was submitted; those sends, every one succeeded."""
        self._done.extend(self._land())
        out, self._done = self._done, []
        return out

    def drain(self, timeout: float | None = None) -> bool:
        """Land what was submitted (reported at :meth:`finished`)."""
        self._done.extend(self._land())
        return True

    def close(self) -> None:
        """Land what was submitted."""
        self._done.extend(self._land())


if TYPE_CHECKING:
    _check_link: type[BlockSender] = LinkSender
    _check_loop: type[BlockSender] = LoopbackSender
