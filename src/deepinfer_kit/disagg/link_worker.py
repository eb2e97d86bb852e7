"""DeviceSlotWorker: the device side of a device link — block copies between the pool and
slots on the same device (a send buffer the link sends from, landing slots it receives
into), ordered around the round's forward; no host copy."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepinfer_kit.cache.hybrid_kv import KVStorage
from deepinfer_kit.cache.tiers.layer_targets import layer_targets
from deepinfer_kit.cache.tiers.records import TransferOutput, TransferPlan
from deepinfer_kit.errors import InvariantError

__all__ = ["DeviceSlotWorker"]


class DeviceSlotWorker:
    """A :class:`~deepinfer_kit.cache.tiers.protocols.KVConnectorWorker` whose saves copy
    pool blocks into ``send`` slots and whose loads copy ``landing`` slots into pool
    blocks, every model layer of each (a hybrid cache's sliding layers through their
    group's blocks, ``TransferPlan.save_groups`` / ``load_groups``), all on the pool's
    device and the runner's stream: the saves before the round's copy-on-write copies
    and forward, the loads after them and before the forward. On CUDA the saves' event
    is synchronised in :meth:`get_finished`, so a saved slot the link then sends holds
    its bytes.

    Args:
        kv: the device pool(s).
        send: ``[S, *kv.block_shape]`` on ``kv.device`` (None: this side sends nothing).
        landing: ``[N, *kv.block_shape]`` on ``kv.device`` (None: it loads nothing).

    Raises:
        InvariantError: a buffer of another shape, dtype or device than the pool's blocks.
    """

    def __init__(self, kv: KVStorage, send: torch.Tensor | None, landing: torch.Tensor | None) -> None:
        for name, buf in (("send", send), ("landing", landing)):
            if buf is not None and (tuple(buf.shape[1:]) != tuple(kv.block_shape) or buf.dtype != kv.dtype
                                    or buf.device != kv.device):
                raise InvariantError(f"{name} slots {tuple(buf.shape)} {buf.dtype} on {buf.device} do not hold "
                                     f"blocks {tuple(kv.block_shape)} {kv.dtype} on {kv.device}")
        self._kv = kv
        self._send = send
        self._landing = landing
        self._saved: list[int] = []
        self._event: torch.cuda.Event | None = None
        self._asked = False

    def start_save_kv(self, plan: TransferPlan) -> None:
        """Copy each ``(block, slot)`` of ``plan.saves`` into its send slot. Writes the send
        slots only.

        Raises:
            InvariantError: saves with no send slots, or a window missing (hybrid).
        """
        if not plan.saves:
            return
        if self._send is None:
            raise InvariantError(f"{len(plan.saves)} saves planned on a link side with no send slots")
        self._asked = True
        kv = self._kv
        slots = torch.tensor([s for _, s in plan.saves], dtype=torch.int64, device=kv.device)
        for layer, t in enumerate(layer_targets(kv, [b for b, _ in plan.saves], plan.save_groups)):
            if t.pool is None or t.rows is not None:
                raise InvariantError(f"link save of {len(plan.saves)} blocks: layer {layer} holds only "
                                     f"{t.blocks.numel()} of them (a window missing)")
            self._send[:, layer].index_copy_(0, slots, t.pool.read_blocks(t.local, t.blocks))
        if kv.device.type == "cuda":
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record()
        self._saved.extend(s for _, s in plan.saves)

    def start_load_kv(self, plan: TransferPlan) -> None:
        """Copy each ``(slot, block)`` of ``plan.loads`` from its landing slot into the pool.

        Raises:
            InvariantError: loads with no landing slots.
        """
        if not plan.loads:
            return
        if self._landing is None:
            raise InvariantError(f"{len(plan.loads)} loads planned on a link side with no landing slots")
        self._asked = True
        kv = self._kv
        slots = torch.tensor([s for s, _ in plan.loads], dtype=torch.int64, device=kv.device)
        data = self._landing.index_select(0, slots)
        for layer, t in enumerate(layer_targets(kv, [b for _, b in plan.loads], plan.load_groups)):
            if t.pool is not None:
                t.pool.write_blocks(t.local, t.blocks, t.pick(data[:, layer]))

    def wait_for_load(self) -> None:
        """Nothing to wait for: the loads are on the forward's stream (or done, CPU)."""

    def get_finished(self) -> TransferOutput | None:
        """The send slots saved since the last call (their copies finished); None when
        nothing was asked."""
        if not self._asked:
            return None
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        out = TransferOutput(saved=self._saved)
        self._saved = []
        self._asked = False
        return out


if TYPE_CHECKING:
    from deepinfer_kit.cache.tiers.protocols import KVConnectorWorker

    _check: type[KVConnectorWorker] = DeviceSlotWorker
