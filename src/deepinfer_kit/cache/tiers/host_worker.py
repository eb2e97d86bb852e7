"""HostTransferWorker: the device side of the host tier — block copies between the device
pool and the host slab, layer by layer, ordered around the round's forward."""

from __future__ import annotations

from typing import TYPE_CHECKING

import math

import torch

from deepinfer_kit.cache.hybrid_kv import KVStorage
from deepinfer_kit.cache.tiers.layer_loads import LayerLoads
from deepinfer_kit.cache.tiers.layer_targets import layer_targets
from deepinfer_kit.cache.tiers.records import TransferOutput, TransferPlan
from deepinfer_kit.errors import CapacityError, InvariantError

__all__ = ["HostTransferWorker", "host_slab"]


def host_slab(kv_cache: KVStorage, num_blocks: int) -> torch.Tensor:
    """The host tier's bytes for ``num_blocks`` blocks of ``kv_cache``: a zeroed CPU tensor
    ``[num_blocks, L, planes, P, Hkv, D]`` (``kv_cache.block_shape``: every model layer,
    a hybrid cache's too) in the pool's dtype, pinned when the pool is on CUDA (so copies
    run asynchronously to the host). Allocated once, at engine build.

    Raises:
        CapacityError: the host cannot allocate it (names ``host_blocks`` and the bytes).
    """
    pin = kv_cache.device.type == "cuda"
    shape = (num_blocks, *kv_cache.block_shape)
    try:
        return torch.zeros(shape, dtype=kv_cache.dtype, pin_memory=pin)
    except (RuntimeError, MemoryError) as exc:
        nbytes = math.prod(shape) * torch.empty((), dtype=kv_cache.dtype).element_size()
        raise CapacityError(f"kv_tiers.host_blocks={num_blocks} needs {nbytes} bytes of host memory"
                            f"{' (pinned)' if pin else ''}, which could not be allocated: {exc}") from exc


class HostTransferWorker:
    """A :class:`~deepinfer_kit.cache.tiers.protocols.KVConnectorWorker` between the
    device's K/V (a :class:`PagedKVCache`, or a :class:`HybridKVCache` whose sliding
    layers move their group's blocks, ``TransferPlan.save_groups`` / ``load_groups``) and
    a host slab.

    Saves gather each layer's blocks on the device into one staging tensor and copy it to
    the host with one non-blocking copy (pinned memory on CUDA, on the runner's stream, so
    it is ordered before the forward that may overwrite an evicted block); the slab
    slots are filled from it when :meth:`get_finished` (or a load reading a slot saved in
    the same round) waits for it. Loads gather the slab's slots into one staging tensor,
    copy it to the device without blocking and scatter it layer by layer into the pool,
    on the same stream, before the forward. On the CPU every copy is done on return.

    With ``layerwise`` (the default) loads are instead copied layer by layer beside the
    forward (:class:`~deepinfer_kit.cache.tiers.layer_loads.LayerLoads`: a stream of their
    own on CUDA, a thread on the CPU), and the forward waits for each layer's copy just
    before that layer (:meth:`wait_for_layer_load`): layer ``i + 1``'s copy overlaps layer
    ``i``'s compute.

    Args:
        kv_cache: the device pool(s).
        slab: the host tier's bytes (:func:`host_slab`).
        layerwise: per-layer loads (``TierConfig.layerwise_loads``).
    """

    def __init__(self, kv_cache: KVStorage, slab: torch.Tensor, *, layerwise: bool = True) -> None:
        self._kv = kv_cache
        self._slab = slab
        self._cuda = kv_cache.device.type == "cuda"
        self._layers = LayerLoads(kv_cache) if layerwise else None
        self._saving: tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None] | None = None
        self._saved: list[int] = []
        self._asked = False
        self._keep: list[torch.Tensor] = []  # staging a non-blocking load still reads

    def start_save_kv(self, plan: TransferPlan) -> None:
        """Copy ``plan.saves`` toward the slab (see the class docstring)."""
        if not plan.saves:
            return
        self._asked = True
        self._settle()
        kv = self._kv
        targets = layer_targets(kv, [b for b, _ in plan.saves], plan.save_groups)
        slots = torch.tensor([s for _, s in plan.saves], dtype=torch.int64)
        staged = torch.empty((len(plan.saves), *kv.block_shape), dtype=kv.dtype, device=kv.device)
        for layer, t in enumerate(targets):
            if t.pool is None or t.rows is not None:
                raise InvariantError(f"tier save of {len(plan.saves)} blocks: layer {layer} holds only "
                                     f"{t.blocks.numel()} of them (a window missing)")
            staged[:, layer] = t.pool.read_blocks(t.local, t.blocks)
        host = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=self._cuda)
        host.copy_(staged, non_blocking=self._cuda)
        event = None
        if self._cuda:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
        self._saving = (host, slots, event)
        self._saved.extend(s for _, s in plan.saves)

    def _settle(self) -> None:
        """Wait for the saves in flight and write them into their slab slots."""
        saving, self._saving = self._saving, None
        if saving is None:
            return
        host, slots, event = saving
        if event is not None:
            event.synchronize()
        self._slab.index_copy_(0, slots, host)

    def start_load_kv(self, plan: TransferPlan) -> None:
        """Copy ``plan.loads`` into the device pool (see the class docstring)."""
        if not plan.loads:
            return
        self._asked = True
        if self._saving is not None and {s for s, _ in plan.loads} & set(self._saving[1].tolist()):
            self._settle()  # a load reads a slot this round saves
        targets = layer_targets(self._kv, [b for _, b in plan.loads], plan.load_groups)
        if self._layers is not None:
            self._layers.start(self._slab, [s for s, _ in plan.loads], targets)
            return
        slots = torch.tensor([s for s, _ in plan.loads], dtype=torch.int64)
        staged = self._slab.index_select(0, slots)
        if self._cuda:
            staged = staged.pin_memory()
            self._keep.append(staged)
        data = staged.to(self._kv.device, non_blocking=self._cuda)
        for layer, t in enumerate(targets):
            if t.pool is not None:
                t.pool.write_blocks(t.local, t.blocks, t.pick(data[:, layer]))

    def wait_for_layer_load(self, layer: int) -> None:
        """Called inside the forward before layer ``layer`` first touches its cache: order
        that layer's loads before it (CUDA: a stream dependency; CPU: until copied). A no-op
        without ``layerwise`` (the loads were ordered at :meth:`start_load_kv`).

        Raises:
            Exception: what the copy raised (the round fails).
        """
        if self._layers is not None:
            self._layers.wait_layer(layer)

    def wait_for_load(self) -> None:
        """Order every load started before what follows: with ``layerwise``, the
        forward's stream waits for the last layer (CUDA) or the copies are joined (CPU);
        without, nothing to wait for (the loads are on the forward's stream, or done).

        Raises:
            Exception: what a layerwise copy raised.
        """
        if self._layers is not None:
            self._layers.wait_all()

    def close(self) -> None:
        """Finish the loads in flight and stop the copy thread (the engine's close)."""
        if self._layers is not None:
            self._layers.close()

    def get_finished(self) -> TransferOutput | None:
        """The slots saved since the last call (after settling them); None when nothing
        was asked."""
        if not self._asked:
            return None
        self._settle()
        self._keep.clear()  # the round's forward, after the loads, has finished by now
        if self._layers is not None:
            self._layers.release()
        out = TransferOutput(saved=self._saved)
        self._saved = []
        self._asked = False
        return out


if TYPE_CHECKING:
    from deepinfer_kit.cache.tiers.protocols import LayerwiseKVConnectorWorker

    _check: type[LayerwiseKVConnectorWorker] = HostTransferWorker
