"""SendLedger: the books of a device link's sending half — which send slots are free,
which hold a block waiting for its copy, being copied or being sent, and which blocks got
across."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from deepinfer_kit.cache.tiers.records import TierStats, TransferOutput
from deepinfer_kit.disagg.link_sender import BlockSender
from deepinfer_kit.errors import InvariantError

__all__ = ["SendLedger"]

_SENT_MEMORY = 1 << 16  # keys remembered as sent (down)


class SendLedger:
    """The sending half of :class:`~deepinfer_kit.disagg.link_connector.DeviceLinkConnector`,
    on the scheduler's thread.

    A block to send takes a free slot of ``slots`` (``[S, *block_shape]`` on the pool's
    device) and waits in :meth:`take_saves` for the next round's plan, whose device side
    copies it there; reported copied (:meth:`copied`), it goes to ``sender``; its slot is
    free again when the send ended (:meth:`settle`). A block sent, and not refused or
    unsendable since, counts as :meth:`down`. Counters go to ``stats``: ``saved_host``
    (sent), ``refused`` (no free slot), ``failed_writes`` (a copy or send that failed).
    """

    def __init__(self, sender: BlockSender, slots: torch.Tensor, stats: TierStats) -> None:
        self.sender = sender
        self.slots = slots
        self._stats = stats
        self._free = list(range(int(slots.shape[0]) - 1, -1, -1))
        self._saves: list[tuple[int, int]] = []  # (device block, send slot), not yet in a plan
        self._saving: dict[int, bytes] = {}  # send slot -> key: queued or being copied
        self._sending: dict[int, bytes] = {}  # send slot -> key: handed to the sender
        self._sent: OrderedDict[bytes, None] = OrderedDict()

    def queue(self, keys: Sequence[bytes], blocks: Sequence[int], savable: Sequence[bool] | None) -> None:
        """Send the device ``blocks`` holding ``keys``: each one not already on its way
        takes a free slot. One not ``savable`` (its window gone), one finding no free slot
        and every one while the link is broken is not sent, and no longer counts as sent
        (an earlier send of it does not vouch for a copy the peer may have lost)."""
        if self.sender.broken:  # nothing more gets across: copy nothing
            self._stats.failed_writes += len(keys)
            for key in keys:
                self._sent.pop(key, None)
            return
        busy = set(self._saving.values()) | set(self._sending.values())
        for i, (key, block) in enumerate(zip(keys, blocks)):
            if savable is not None and not savable[i]:
                self._sent.pop(key, None)
                continue
            if key in busy:
                continue
            if not self._free:
                self._stats.refused += 1
                self._sent.pop(key, None)
                continue
            slot = self._free.pop()
            self._saves.append((block, slot))
            self._saving[slot] = key
            busy.add(key)

    def take_saves(self) -> list[tuple[int, int]]:
        """The ``(device block, send slot)`` copies queued since the last call (a round's
        ``TransferPlan.saves``)."""
        out, self._saves = self._saves, []
        return out

    def copied(self, output: TransferOutput) -> None:
        """The device side's report: copied slots go to the sender; failed ones are free."""
        for slot in output.failed_saves:
            if self._saving.pop(slot, None) is not None:
                self._free.append(slot)
                self._stats.failed_writes += 1
        for slot in output.saved:
            key = self._saving.pop(slot, None)
            if key is not None:
                self._sending[slot] = key
                self.sender.submit(key, self.slots[slot], slot)

    def settle(self) -> None:
        """Free the slots of the sends that ended; remember what got across."""
        for slot, ok in self.sender.finished():
            key = self._sending.pop(slot)
            self._free.append(slot)
            if ok:
                self._sent[key] = None
                self._sent.move_to_end(key)
                if len(self._sent) > _SENT_MEMORY:
                    self._sent.popitem(last=False)
                self._stats.saved_host += 1
            else:
                self._sent.pop(key, None)
                self._stats.failed_writes += 1

    def pending(self, keys: Sequence[bytes]) -> bool:
        """Any of ``keys`` queued, being copied or being sent."""
        self.settle()
        busy = set(self._saving.values()) | set(self._sending.values())
        return any(k in busy for k in keys)

    def down(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, count as sent."""
        n = 0
        for key in keys:
            if key not in self._sent:
                break
            n += 1
        return n

    def drain(self) -> None:
        """Wait for every send handed over to end, then settle."""
        self.sender.drain()
        self.settle()

    def forget(self) -> None:
        """Count nothing as sent (``reset_prefix_cache``)."""
        self._sent.clear()

    def check_idle(self) -> None:
        """Every slot free or holding a block on its way (no request holds one).

        Raises:
            InvariantError: a slot lost, or a queued copy without its slot.
        """
        self.settle()
        total = int(self.slots.shape[0])
        if len(self._free) + len(self._saving) + len(self._sending) != total or len(self._saves) > len(self._saving):
            raise InvariantError(f"device link: send slots {len(self._free)} free + {len(self._saving)} "
                                 f"saving + {len(self._sending)} sending of {total}")
