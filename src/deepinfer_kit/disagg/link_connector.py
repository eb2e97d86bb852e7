"""DeviceLinkConnector: the scheduler side of a device link — a prefill engine sends its
prompt blocks from device memory, a decode engine loads them from landing slots on its
device; the blocks never pass through host memory when the link runs over NCCL."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from deepinfer_kit.cache.tiers.records import EventLog, KVEvent, TierStats, TransferOutput, TransferPlan
from deepinfer_kit.disagg.landing import LandingSlots
from deepinfer_kit.disagg.link_sender import BlockSender
from deepinfer_kit.disagg.send_ledger import SendLedger
from deepinfer_kit.errors import InvariantError
from deepinfer_kit.request import Request

__all__ = ["DeviceLinkConnector", "link_id"]

def link_id(hash_key: bytes, source: int = 0) -> str:
    """The name both ends of a link give it: 16 hex digits derived from the hash key they
    share and the sender's number (``source``: which prefill engine of those feeding one
    decode engine); says nothing about the key. Pure."""
    return hashlib.blake2b(hash_key + source.to_bytes(4, "little"), digest_size=8, person=b"kv-link").hexdigest()


class DeviceLinkConnector:
    """A :class:`~deepinfer_kit.cache.tiers.protocols.KVConnectorScheduler` with two
    halves, either or both present:

    * **Sending** (``sender`` and ``send_slots``, the prefill side): every full prompt
      block of a request with ``KVRequestParams(save_prompt=True)`` (of every request
      with ``send_all``; never of one with ``write=False``) is copied, at publish, into a
      free send slot on the device (a save of the round's plan, run by
      :class:`~deepinfer_kit.disagg.link_worker.DeviceSlotWorker` before the forward),
      then handed to ``sender``; the slot is free again when the send ended. The blocks
      such a request took from its own device cache are sent too, at its admission (the
      decode side may not hold them). A block finding no free send slot is not sent
      (``stats.refused``); the decode side recomputes it.
    * **Landing** (``landing``, the decode side): a request's leading blocks after its
      device hit that are in the landing slots load from there into its fresh blocks, a
      device-to-device copy before the round's forward. A request with
      ``load_remote`` waits at its first admission attempt, up to ``timeout_s`` after
      its arrival, for the blocks it was told of (``remote_blocks``; every prompt block
      when unset); one still missing then is recomputed (``stats.late_reads``). A
      request told of blocks sent on a link it does not receive on (``remote_link`` not
      one of :attr:`accepts`) waits for none (``foreign`` counts them), nor one whose
      sender's link ended.

    ``keys_pending`` / ``keys_down`` let the prefill side answer once a prompt is
    across (``TieredKVCacheManager.settled_saves``); ``drain`` waits for the sends.
    KV events: ``device`` for the pool's blocks, ``host`` for the landing slots (a
    medium below the pool from which this engine loads).

    Args:
        block_size: tokens per block.
        hash_key: the block identities' key, equal on both sides (the engine's manager
            reads it from here when ``kv_tiers`` does not set one).
        sender, send_slots: the sending half (``send_slots``: ``[S, *block_shape]`` on
            the pool's device, shared with the worker).
        landing: the landing half.
        timeout_s: how long a ``load_remote`` request waits for its blocks.
        send_all: send the prompt blocks of every request.
        source: this sending half's number (its :attr:`link_id`).
        sources: the senders the landing half receives from (:attr:`accepts`).
    """

    saves_on_eviction = False  # blocks are sent at publish, never at eviction

    def __init__(self, block_size: int, hash_key: bytes, *, sender: BlockSender | None = None,
                 send_slots: torch.Tensor | None = None, landing: LandingSlots | None = None,
                 timeout_s: float = 5.0, send_all: bool = False, source: int = 0,
                 sources: Sequence[int] = (0,)) -> None:
        if (sender is None) != (send_slots is None):
            raise InvariantError("a device link's sending half needs both a sender and send slots")
        self.block_size = block_size
        self.hash_key = hash_key
        self.accepts = {link_id(hash_key, s): s for s in sources}  # the links the landing half receives on
        self.link_id = link_id(hash_key, source) if sender is not None else next(iter(self.accepts))
        self.foreign = 0  # load_remote requests told of blocks sent on another link (none waited for)
        self.landing = landing
        self.timeout_s = timeout_s
        self.send_all = send_all
        self._stats = TierStats()
        self._events = EventLog()
        self.sends = SendLedger(sender, send_slots, self._stats) if sender is not None and send_slots is not None \
            else None
        self._expect: dict[str, tuple[float, int, int | None]] = {}  # load_remote request -> (deadline, told, source)
        self._pinned: dict[str, list[int]] = {}  # request -> landing slots counted at its last match
        self._loads: list[tuple[int, int]] = []
        self._queued_pins: list[int] = []
        self._round_pins: dict[int, list[int]] = {}  # step -> landing slots its loads read

    # -- sending half ---------------------------------------------------------------------

    @property
    def sender(self) -> BlockSender | None:
        """The sending half's sender (None on a side that only lands)."""
        return self.sends.sender if self.sends is not None else None

    def _sends(self, request: Request) -> bool:
        kv = request.kv_params
        if self.sender is None or (kv is not None and not kv.write):
            return False
        return self.send_all or (kv is not None and kv.save_prompt)

    def on_device_hit(self, request: Request, keys: Sequence[bytes], blocks: Sequence[int],
                      savable: Sequence[bool] | None = None) -> None:
        """At admission: ``blocks`` (device, published, held by ``request``) hold its
        leading ``keys`` from the device cache. A sending request sends them too, but for
        those not ``savable`` (a hybrid cache without their windows), which no longer
        count as sent: the decode side is told only of blocks that come."""
        if self.sends is not None and self._sends(request):
            self.sends.queue(keys, blocks, savable)

    def on_published(self, request: Request, start: int, keys: Sequence[bytes], blocks: Sequence[int],
                     savable: Sequence[bool] | None = None) -> None:
        """Log the device blocks; a sending request's prompt blocks are queued for sending."""
        self._events.add("stored", "device", keys)
        if self.sends is not None and self._sends(request):
            usable = (request.num_prompt_tokens - 1) // self.block_size  # a reader computes the last token
            prompt = max(0, min(len(keys), usable - start))
            self.sends.queue(keys[:prompt], blocks[:prompt], savable[:prompt] if savable is not None else None)

    def on_evicted(self, keys: Sequence[bytes], blocks: Sequence[int], writable: Sequence[bool]) -> None:
        """Log the device blocks gone (nothing is saved at eviction)."""
        self._events.add("removed", "device", keys)

    def keys_pending(self, keys: Sequence[bytes]) -> bool:
        """Any of ``keys`` queued, being copied or being sent."""
        return self.sends is not None and self.sends.pending(keys)

    def keys_down(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, were sent (and count as sent still)."""
        return self.sends.down(keys) if self.sends is not None else 0

    def drain(self) -> None:
        """Wait for every send handed over to end (``transfer_idle``)."""
        if self.sends is not None:
            self.sends.drain()

    # -- landing half ---------------------------------------------------------------------

    def on_arrival(self, request: Request, keys: Sequence[bytes], first: int) -> None:
        """A ``load_remote`` request starts its wait for the blocks it was told of."""
        kv = request.kv_params
        if self.landing is not None and kv is not None and kv.load_remote:
            source = self.accepts.get(kv.remote_link) if kv.remote_link is not None else None
            if kv.remote_link is not None and source is None:
                self.foreign += 1  # sent elsewhere: nothing will land here for it
                return
            told = len(keys) if kv.remote_blocks is None else min(len(keys), kv.remote_blocks)
            self._expect[request.request_id] = (time.monotonic() + self.timeout_s, told, source)

    def get_num_new_matched_tokens(self, request: Request, keys: Sequence[bytes], first: int) -> int:
        """The landed blocks right after the device hit, pinned for the request (the
        first attempt of a ``load_remote`` request waits for those it was told of)."""
        self._unpin(request.request_id)
        if self.landing is None:
            return 0
        deadline, told, source = self._expect.pop(request.request_id, (None, 0, None))
        slots = self.landing.take(keys[first:], told - first, deadline, source)  # counted and pinned at once
        n = len(slots)
        if deadline is not None and first + n < told:
            self._stats.late_reads += told - first - n
        if n:
            self._pinned[request.request_id] = slots
        return n

    def update_state_after_alloc(self, request: Request, blocks: Sequence[int]) -> None:
        """Queue the loads of the first ``len(blocks)`` counted slots; release the rest."""
        slots = self._pinned.pop(request.request_id, [])
        used = slots[:len(blocks)]
        self._loads.extend(zip(used, blocks))
        self._queued_pins.extend(used)
        self._stats.host_hits += len(used)
        self._stats.loaded_tokens += len(used) * self.block_size
        if self.landing is not None and len(slots) > len(used):
            self.landing.unpin(slots[len(used):])

    def _unpin(self, request_id: str) -> None:
        slots = self._pinned.pop(request_id, None)
        if slots and self.landing is not None:
            self.landing.unpin(slots)

    def request_finished(self, request: Request) -> None:
        """Drop the request's pins and its wait."""
        self._unpin(request.request_id)
        self._expect.pop(request.request_id, None)

    # -- rounds ---------------------------------------------------------------------------

    def build_transfers(self, step_id: int) -> TransferPlan:
        """The sends' copies and the loads queued since the last round."""
        plan = TransferPlan(saves=self.sends.take_saves() if self.sends is not None else [], loads=self._loads)
        if self._queued_pins:
            self._round_pins.setdefault(step_id, []).extend(self._queued_pins)
        self._loads, self._queued_pins = [], []
        return plan

    def update_from_output(self, step_id: int, output: TransferOutput | None) -> None:
        """Hand the copied blocks to the sender; release the slots this round's loads read."""
        if self.sends is not None:
            if output is not None:
                self.sends.copied(output)
            self.sends.settle()
        for step in [s for s in self._round_pins if s <= step_id or step_id < 0]:
            if self.landing is not None:
                self.landing.unpin(self._round_pins.pop(step))

    def take_events(self) -> list[KVEvent]:
        """Device events, then the landing slots' (as ``host``)."""
        if self.landing is not None:
            stored, removed = self.landing.take_changes()
            self._events.add("stored", "host", stored)
            self._events.add("removed", "host", removed)
        return self._events.take()

    @property
    def stats(self) -> TierStats:
        """``host_hits`` / ``loaded_tokens``: blocks and tokens loaded from the landing
        slots; ``saved_host``: blocks sent; ``refused``: blocks not sent for want of a
        send slot; ``failed_writes``: copies or sends that failed; ``late_reads``: blocks
        told of that had not landed in time."""
        return self._stats

    def reset(self) -> None:
        """Forget the landed blocks no load pins and what was sent."""
        if self.landing is not None:
            self.landing.clear()
        if self.sends is not None:
            self.sends.forget()
        self._events.add("cleared", "host")

    def check_idle(self) -> None:
        """Nothing pinned for a request, and every send slot accounted for: free, or
        holding a block queued, being copied or being sent (sends still under way are no
        leak: :meth:`drain` waits for them).

        Raises:
            InvariantError: naming what is held or lost.
        """
        pinned = sum(map(len, self._pinned.values())) + sum(map(len, self._round_pins.values()))
        if pinned or self._loads or self._expect:
            raise InvariantError(f"device link holds {pinned} landing pins, {len(self._loads)} queued loads and "
                                 f"{len(self._expect)} waits with no request live")
        if self.sends is not None:
            self.sends.check_idle()
        if self.landing is not None:
            self.landing.check_idle()

    def close(self) -> None:
        """Finish the queued sends and stop the sender."""
        if self.sender is not None:
            self.sender.close()


if TYPE_CHECKING:
    from deepinfer_kit.cache.tiers.protocols import KVConnectorScheduler

    _check: type[KVConnectorScheduler] = DeviceLinkConnector
