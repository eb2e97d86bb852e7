"""LayerGatedStore: the KV store a forward sees in a round whose KV tier loads arrive layer
by layer — the first touch of a layer's cache waits for that layer's loads. ``gate_store``
builds it over a plain pool or a hybrid one."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from deepinfer_kit.cache.hybrid_kv import HybridKVCache
from deepinfer_kit.models.protocols import PagedKVStore

__all__ = ["LayerGatedStore", "gate_store"]


def gate_store(store: PagedKVStore, ready: Callable[[int], None]) -> PagedKVStore:
    """The store a forward uses while the KV connector's loads land layer by layer:
    ``ready`` (the connector's ``wait_for_layer_load``, numbered as the model's layers) is
    called before a layer's first use. Over a :class:`HybridKVCache` every layer waits
    too: the loads fill the full-attention group's blocks and the sliding groups' windows.
    Called by the runner once per round with loads."""
    if isinstance(store, HybridKVCache):
        return GroupedLayerGatedStore(store, ready)
    return LayerGatedStore(store, ready)


class LayerGatedStore:
    """A :class:`~deepinfer_kit.models.protocols.PagedKVStore` over ``store`` that calls
    ``ready(layer)`` before the first :meth:`key_cache`, :meth:`value_cache`,
    :meth:`write` or :meth:`slot_caches` of each layer, so any model (it reaches the cache
    only through those) waits for exactly the layers it is about to use. Everything else
    (the pool's attributes, a grouped store's tables) is the store's own.

    Built by the runner for one eager forward; not for a captured CUDA graph, which reads
    the cache without calling back (the runner waits for every layer before replaying).

    Args:
        store: the runner's pool.
        ready: the KV connector's ``wait_for_layer_load``.
    """

    def __init__(self, store: PagedKVStore, ready: Callable[[int], None]) -> None:
        self._store = store
        self._ready = ready
        self._open: set[int] = set()

    def _gate(self, layer: int) -> None:
        """Wait for ``layer``'s loads the first time it is touched."""
        if layer not in self._open:
            self._ready(layer)
            self._open.add(layer)

    def key_cache(self, layer: int, /) -> torch.Tensor:
        """The store's, after ``layer``'s loads."""
        self._gate(layer)
        return self._store.key_cache(layer)

    def value_cache(self, layer: int, /) -> torch.Tensor:
        """The store's, after ``layer``'s loads."""
        self._gate(layer)
        return self._store.value_cache(layer)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, /) -> None:
        """The store's, after ``layer``'s loads."""
        self._gate(layer)
        self._store.write(layer, key, value, slot_mapping)

    def slot_caches(self, layer: int, /) -> tuple[torch.Tensor, torch.Tensor]:
        """The store's, after ``layer``'s loads."""
        self._gate(layer)
        return self._store.slot_caches(layer)

    def __getattr__(self, name: str) -> Any:
        """Any other attribute of the store (``pad_slot``, ``num_layers``, ...)."""
        return getattr(self._store, name)


class GroupedLayerGatedStore(LayerGatedStore):
    """A :class:`LayerGatedStore` over a store with layer groups, which it shows as one
    (``models.layer_attention.GroupedKVStore``: the members are its own, not looked up)."""

    def __init__(self, store: HybridKVCache, ready: Callable[[int], None]) -> None:
        super().__init__(store, ready)
        self._grouped = store

    @property
    def pad_slot(self) -> int:
        """The store's."""
        return self._grouped.pad_slot

    @property
    def group_of_layer(self) -> tuple[int, ...]:
        """The store's."""
        return self._grouped.group_of_layer

    def group_tables(self, slot_mapping: torch.Tensor,
                     block_tables: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The store's."""
        return self._grouped.group_tables(slot_mapping, block_tables)


if TYPE_CHECKING:
    from deepinfer_kit.models.layer_attention import GroupedKVStore

    _check: type[PagedKVStore] = LayerGatedStore
    _grouped: type[GroupedKVStore] = GroupedLayerGatedStore
