"""Layer-by-layer loads of the host tier (``HostTransferWorker(layerwise=True)``): a
forward reading through ``LayerGatedStore`` sees each layer's loaded blocks, reads layer 0
while later layers are still being copied, and a failed copy fails the round without
hanging it or the next one."""

from __future__ import annotations

import threading

import pytest
import torch

from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.cache.tiers.host_worker import HostTransferWorker, host_slab
from deepinfer_kit.cache.tiers.records import TransferPlan
from deepinfer_kit.engine.runner.layer_gate import LayerGatedStore

_L, _NB, _P, _H, _D = 4, 10, 4, 2, 8
_HANG = 60.0  # seconds: only a broken implementation waits this long (a hang guard, not a timing)


class HeldPool(PagedKVCache):
    """A pool whose load of layer ``i > 0`` waits until the test opens layer ``i``; a load
    that waited in vain is recorded in ``stuck``."""

    def __init__(self) -> None:
        super().__init__(_L, _NB, _P, _H, _D, impl="ref")
        self.open = [threading.Semaphore(0) for _ in range(_L)]
        self.stuck: list[int] = []
        self.fail_layer: int | None = None

    def write_blocks(self, layer: int, blocks: torch.Tensor, data: torch.Tensor) -> None:
        if layer and not self.open[layer].acquire(timeout=_HANG):
            self.stuck.append(layer)
        if layer == self.fail_layer:
            raise RuntimeError(f"copy of layer {layer} failed")
        super().write_blocks(layer, blocks, data)


def _filled_slab(kv: PagedKVCache, slots: int) -> torch.Tensor:
    slab = host_slab(kv, slots)
    slab.copy_(torch.randn(slab.shape))
    return slab


def test_each_layer_is_read_after_its_copy_and_before_the_next_layers_copy() -> None:
    kv = HeldPool()
    slab = _filled_slab(kv, 6)
    worker = HostTransferWorker(kv, slab)
    loads = [(5, 2), (0, 7), (3, 4)]
    worker.start_load_kv(TransferPlan([], loads))

    def ready(layer: int) -> None:  # the test's forward reaching layer ``layer``
        kv.open[layer].release()
        worker.wait_for_layer_load(layer)

    gate = LayerGatedStore(kv, ready)
    for layer in range(_L):  # layer i + 1 is not copied until layer i was read: only a per-layer wait gets through
        keys, values = gate.key_cache(layer), gate.value_cache(layer)
        for slot, block in loads:
            assert torch.equal(keys[block], slab[slot, layer, 0]), (layer, slot, block)
            assert torch.equal(values[block], slab[slot, layer, 1]), (layer, slot, block)
    worker.wait_for_load()
    assert kv.stuck == []
    assert worker.get_finished() is not None
    worker.close()


def test_a_failed_copy_fails_at_the_layer_wait_and_the_next_round_loads() -> None:
    kv = HeldPool()
    slab = _filled_slab(kv, 4)
    worker = HostTransferWorker(kv, slab)
    for layer in range(1, _L):
        kv.open[layer].release()
    kv.fail_layer = 2
    worker.start_load_kv(TransferPlan([], [(1, 3)]))
    worker.wait_for_layer_load(0)
    worker.wait_for_layer_load(1)
    with pytest.raises(RuntimeError, match="copy of layer 2 failed"):
        worker.wait_for_layer_load(2)
    worker.wait_for_load()  # the failure was raised once; nothing left in flight
    worker.get_finished()

    kv.fail_layer = None
    for layer in range(1, _L):
        kv.open[layer].release()
    worker.start_load_kv(TransferPlan([], [(2, 5)]))
    worker.wait_for_load()
    assert torch.equal(kv._kv[:, :, 5], slab[2])  # noqa: SLF001 - every layer, both planes
    assert kv.stuck == []
    worker.close()


def test_a_round_whose_forward_raised_is_joined_before_the_next() -> None:
    kv = HeldPool()
    slab = _filled_slab(kv, 4)
    worker = HostTransferWorker(kv, slab)
    worker.start_load_kv(TransferPlan([], [(0, 1)]))
    worker.wait_for_layer_load(0)  # the forward fails after layer 0; later layers still queued
    for layer in range(1, _L):
        kv.open[layer].release()
    worker.wait_for_load()  # the runner's wait after a failed forward: the copies are done
    assert torch.equal(kv._kv[:, :, 1], slab[0])  # noqa: SLF001
    worker.close()


def test_without_layerwise_the_loads_are_done_at_start() -> None:
    kv = PagedKVCache(_L, _NB, _P, _H, _D, impl="ref")
    slab = _filled_slab(kv, 3)
    worker = HostTransferWorker(kv, slab, layerwise=False)
    worker.start_load_kv(TransferPlan([], [(2, 0)]))
    assert torch.equal(kv._kv[:, :, 0], slab[2])  # noqa: SLF001
    worker.wait_for_layer_load(1)  # no-ops
    worker.wait_for_load()
    worker.close()


def test_the_gate_waits_once_per_layer_and_passes_the_rest_through() -> None:
    kv = PagedKVCache(_L, _NB, _P, _H, _D, impl="ref")
    calls: list[int] = []
    gate = LayerGatedStore(kv, calls.append)
    slots = torch.tensor([3, kv.pad_slot])
    key = torch.ones(2, _H, _D)
    gate.write(2, key, key, slots)
    gate.key_cache(2)
    gate.slot_caches(0)
    gate.value_cache(2)
    assert calls == [2, 0]
    assert gate.pad_slot == kv.pad_slot and gate.num_layers == _L
    assert torch.equal(kv.key_cache(2)[0, 3], key[0])


def test_over_a_hybrid_cache_every_layer_waits_by_its_model_index() -> None:
    """The loads fill the full group's blocks and the sliding groups' windows alike."""
    from deepinfer_kit.cache.hybrid_kv import HybridKVCache
    from deepinfer_kit.cache.layer_groups import KVLayout
    from deepinfer_kit.engine.runner.layer_gate import gate_store
    from deepinfer_kit.models.layer_attention import GroupedKVStore

    layout = KVLayout.from_windows([3, None, 3, 3, None, 3], 1)
    kv = HybridKVCache(layout, 8, [12], 4, 2, 8)
    calls: list[int] = []
    gate = gate_store(kv, calls.append)
    for layer in range(6):
        gate.key_cache(layer)
    assert calls == list(range(6))
    assert isinstance(gate, GroupedKVStore) and gate.group_of_layer == kv.group_of_layer
    assert gate.pad_slot == kv.pad_slot
