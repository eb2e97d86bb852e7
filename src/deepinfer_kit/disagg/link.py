"""KVLink: prefill -> decode across processes or hosts over torch.distributed — the KV
blocks a prefill engine saves, then the requests they belong to, on one ordered channel:
the message format and the receiving thread (both links use them: the disk tier's
:class:`PushStore` here, the device link's sender in :mod:`~deepinfer_kit.disagg.link_sender`)."""

from __future__ import annotations

import datetime
import pickle
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from deepinfer_kit.cache.tiers.disk_store import DiskBlockStore
from deepinfer_kit.disagg.engine import disk_tier
from deepinfer_kit.engine.engine import Engine
from deepinfer_kit.errors import ConfigError

__all__ = ["PushStore", "KVLinkReceiver", "LinkEnd", "BlockSink", "send_message", "send_request", "send_close",
           "push_saved_blocks", "MSG_BLOCK"]

MSG_BLOCK, _REQUEST, _CLOSE = 1, 2, 0  # message kinds on a link


def _p2p(tensor: torch.Tensor, peer: int, group: Any, timeout_s: float | None) -> None:
    """Send ``tensor`` to ``peer``; with ``timeout_s``, raise when it is not out by then
    (a peer that stopped receiving)."""
    if timeout_s is None:
        dist.send(tensor, peer, group=group)
        return
    work = dist.isend(tensor, peer, group=group)
    assert work is not None  # this process is in the group
    work.wait(datetime.timedelta(seconds=timeout_s))


def send_message(kind: int, head: bytes, body: torch.Tensor | None, peer: int, group: Any,
                 data_group: Any = None, timeout_s: float | None = None, count: int = 1) -> None:
    """One message: a header ``[kind, len(head), body bytes, count]`` and ``head`` over
    ``group`` (CPU tensors), then ``body`` over ``data_group`` (NCCL: a device tensor, sent
    device to device) or, without one, over ``group`` (a device ``body`` is copied to the
    host first: gloo sends CPU tensors). A block message carries ``count`` blocks: ``head``
    is the fingerprint then their keys, ``body`` their bytes in that order. With
    ``timeout_s`` each part raises when not out in time."""
    nbytes = body.numel() * body.element_size() if body is not None else 0
    _p2p(torch.tensor([kind, len(head), nbytes, count], dtype=torch.int64), peer, group, timeout_s)
    if head:
        _p2p(torch.frombuffer(bytearray(head), dtype=torch.uint8), peer, group, timeout_s)
    if body is None or not nbytes:
        return
    flat = body.contiguous().view(torch.uint8).reshape(-1)
    if data_group is None:
        _p2p(flat.cpu(), peer, group, timeout_s)
    elif flat.device.type == "cuda":
        stream = torch.cuda.Stream(flat.device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(flat.device))
        with torch.cuda.stream(stream):
            _p2p(flat, peer, data_group, timeout_s)
        stream.synchronize()  # the bytes are out: the caller may overwrite ``body``
    else:
        _p2p(flat, peer, data_group, timeout_s)


class LinkEnd(Protocol):
    """The sending end of a link: what :func:`send_request` and :func:`send_close` need."""

    lock: threading.Lock
    peer: int
    group: Any


class PushStore:
    """A :class:`BlockStore` that writes each block to ``local`` (the prefill engine's own
    disk tier, so its later requests still hit it) and pushes it to the decode process
    ``peer`` over ``group`` (gloo on CPU; the payload is a CPU tensor). ``put`` returns
    when the peer has the bytes (gloo's send), so the prefill side's idle transfer
    (``TieredKVCacheManager.transfer_idle``) returns after every block of a request is
    across. Sends are serialised (the tier's I/O threads share one channel).

    A failed send raises from ``put`` (the tier counts a failed write); the decode side
    then recomputes that block.
    """

    def __init__(self, local: DiskBlockStore, peer: int, group: Any = None) -> None:
        self.local = local
        self.peer = peer
        self.group = group
        self.lock = threading.Lock()

    def put(self, key: bytes, payload: Any) -> None:
        """Write locally, then send ``fingerprint + key`` and the bytes to the peer."""
        self.local.put(key, payload)
        with self.lock:
            send_message(MSG_BLOCK, self.local.fingerprint + key, payload, self.peer, self.group)

    def get_into(self, key: bytes, out: Any) -> bool:
        """Read from the local folder."""
        return self.local.get_into(key, out)

    def delete(self, key: bytes) -> None:
        """Delete locally (the peer's copy is the peer's)."""
        self.local.delete(key)


def push_saved_blocks(engine: Engine, peer: int, group: Any = None) -> PushStore:
    """Make ``engine`` (a prefill engine with a disk tier) push every block it writes to
    disk to ``peer`` as well; returns the store (its lock also guards :func:`send_request`).

    Raises:
        ConfigError: the engine has no disk tier.
    """
    disk = disk_tier(engine)
    if disk is None:
        raise ConfigError("push_saved_blocks needs an engine with kv_tiers.disk_blocks > 0")
    if not isinstance(disk.store, DiskBlockStore):
        raise ConfigError("push_saved_blocks: the engine's disk tier is already wrapped")
    store = PushStore(disk.store, peer, group)
    disk.store = store
    return store


def send_request(store: LinkEnd, request_id: str, prompt: list[int], params: Any) -> None:
    """Hand ``request_id`` to the decode process, after its blocks (same channel, in order)."""
    with store.lock:
        send_message(_REQUEST, pickle.dumps((request_id, prompt, params)), None, store.peer, store.group)


def send_close(store: LinkEnd) -> None:
    """Tell the decode process nothing more comes."""
    with store.lock:
        send_message(_CLOSE, b"", None, store.peer, store.group)


class BlockSink(Protocol):
    """Where a :class:`KVLinkReceiver` puts the blocks it receives: a disk tier's folder
    (:class:`DiskBlockStore`) or a decode engine's landing slots
    (:class:`~deepinfer_kit.disagg.landing.LandingSlots`)."""

    fingerprint: bytes

    def put(self, key: bytes, payload: torch.Tensor) -> None:
        """Keep ``payload`` (one block's bytes, flat uint8) as ``key``; called on the
        receiving thread."""
        ...


class KVLinkReceiver:
    """The decode side: a thread receiving from ``peer`` — blocks into ``store`` (the
    decode engine's disk tier folder, which ``load_remote`` requests read, or its landing
    slots), requests to ``on_request(request_id, prompt, params)`` — until the close
    message or a failure. A block whose fingerprint is not ``store``'s (another model,
    dtype or block shape) is dropped, never stored. The channel ends at the close message
    or a failure (``error`` holds it; a dead prefill process ends the channel, and
    requests whose blocks never came are recomputed by the decode engine); then a sink
    with a ``close`` method is closed (landing slots stop waiting for blocks).

    Blocks arrive over ``data_group`` when given (NCCL between GPUs: into a buffer on
    ``device``, no host copy), else over ``group`` into host memory; headers and requests
    always over ``group`` (gloo). ``source``: this sender's number at the sink (a sink fed
    by several links closes each on its own).
    """

    def __init__(self, store: BlockSink, on_request: Callable[[str, list[int], Any], None], peer: int,
                 group: Any = None, *, data_group: Any = None, device: torch.device | str | None = None,
                 source: int = 0) -> None:
        self.store = store
        self.source = source
        self.on_request = on_request
        self.peer = peer
        self.group = group
        self.data_group = data_group
        self.device = torch.device(device) if device is not None and data_group is not None else torch.device("cpu")
        self.error: BaseException | None = None
        self.rejected = 0  # blocks of another layout or model, dropped
        self.thread = threading.Thread(target=self._loop, name="kv-link", daemon=True)
        self.thread.start()

    def _recv(self, n: int) -> torch.Tensor:
        buf = torch.empty(n, dtype=torch.uint8)
        dist.recv(buf, self.peer, group=self.group)
        return buf

    def _recv_body(self, n: int) -> torch.Tensor:
        if self.data_group is None:
            return self._recv(n)
        buf = torch.empty(n, dtype=torch.uint8, device=self.device)
        if self.device.type != "cuda":
            dist.recv(buf, self.peer, group=self.data_group)
            return buf
        stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            dist.recv(buf, self.peer, group=self.data_group)
        stream.synchronize()
        return buf

    def _blocks(self, head: bytes, body: torch.Tensor, count: int) -> None:
        """Store the ``count`` blocks of one message (``head``: fingerprint, then keys)."""
        if head[:16] != self.store.fingerprint:  # another model's K/V is never stored
            self.rejected += count
            return
        keys, size = head[16:], (len(head) - 16) // count
        names = [keys[i * size:(i + 1) * size] for i in range(count)]
        many = getattr(self.store, "put_many", None)  # landing slots: one copy for the message
        if many is not None:
            many(names, body.view(count, -1))
            return
        for name, chunk in zip(names, body.view(count, -1)):
            self.store.put(name, chunk)

    def _loop(self) -> None:
        try:
            while True:
                header = torch.empty(4, dtype=torch.int64)
                dist.recv(header, self.peer, group=self.group)
                kind, hlen, nbytes, count = (int(x) for x in header.tolist())
                if kind == _CLOSE:
                    return
                head = bytes(self._recv(hlen).numpy()) if hlen else b""
                if kind == MSG_BLOCK:
                    self._blocks(head, self._recv_body(nbytes), count)
                elif kind == _REQUEST:
                    rid, prompt, params = pickle.loads(head)
                    self.on_request(rid, prompt, params)
        except BaseException as exc:  # noqa: BLE001 - the decode side keeps serving; the owner reads it
            self.error = exc
        finally:
            ended = getattr(self.store, "close", None)  # a sink that waits for blocks stops waiting
            if ended is not None:
                ended(self.source)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the channel to end."""
        self.thread.join(timeout)
