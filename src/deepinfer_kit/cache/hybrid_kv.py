"""HybridKVCache: the K/V storage of a model whose layers fall into cache groups — one
:class:`PagedKVCache` per group, sized for what the group keeps.

The full group's pool has a block for every block id of the block tables (the tables the
scheduler and the runner pass around name full-group blocks). A sliding group's pool is
much smaller: its device map ``[NB + 1]`` says which of its blocks holds the K/V of each
full-group block (its block 0 for a block it does not hold, its scratch block for the pad
slot's block ``NB``). Before each forward the runner applies the round's new mappings
(:meth:`apply_table_updates`); :meth:`group_tables` then translates a step's slot mapping
and block tables into each sliding group's, on the device (inside a captured graph too),
and the model gives each layer its group's (``models.layer_attention``). A sliding layer
reads only blocks inside its window, which its group holds; the others map to finite
content (the scratch block, or a block reused by another sequence) outside the window.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from deepinfer_kit._kernels import Impl
from deepinfer_kit._staging import to_device
from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.cache.layer_groups import KVLayout
from deepinfer_kit.errors import ConfigError, InvariantError

__all__ = ["HybridKVCache", "KVStorage"]


class HybridKVCache:
    """Per-group K/V pools behind the one-pool interface of :class:`PagedKVCache`.

    Args:
        layout: the model's layer groups (``KVLayout.from_windows``).
        num_blocks: blocks of the full group (the ids of the block tables).
        group_blocks: blocks of each sliding group's pool, in group order.
        block_size, num_kv_heads, head_dim, dtype, device, impl: as :class:`PagedKVCache`.

    Raises:
        ConfigError: sizes that do not match the layout; as :class:`PagedKVCache`.
        CapacityError: a pool the device cannot allocate.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, group_blocks: Sequence[int], block_size: int,
                 num_kv_heads: int, head_dim: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", impl: Impl = "auto") -> None:
        sliding = layout.sliding()
        if len(group_blocks) != len(sliding):
            raise ConfigError(f"group_blocks must give {len(sliding)} pool sizes, got {list(group_blocks)}")
        self.layout = layout
        self._nb = num_blocks
        self._P = block_size
        sizes = [num_blocks] + list(group_blocks)
        self._pools: list[PagedKVCache | None] = []
        for g in range(layout.num_groups):
            layers = len(layout.layers_of(g))
            self._pools.append(PagedKVCache(layers, sizes[g], block_size, num_kv_heads, head_dim, dtype=dtype,
                                            device=device, impl=impl) if layers else None)
        self._where = [(g, layout.layers_of(g).index(i)) for i, g in enumerate(layout.group_of_layer)]
        dev = torch.device(device)
        self._device = dev
        # Unmapped blocks read the group's block 0 (in range for a gather that checks, finite,
        # outside every window); the pad slot's block maps to the group's scratch block.
        self._maps: dict[int, torch.Tensor] = {}
        for g, _ in sliding:
            table = torch.zeros(num_blocks + 1, dtype=torch.int64, device=dev)
            table[num_blocks] = sizes[g]
            self._maps[g] = table
        self._host: dict[int, dict[int, int]] = {g: {} for g, _ in sliding}
        self._dtype, self._heads, self._dim = dtype, num_kv_heads, head_dim
        self._impl: Literal["ref", "triton"] = next(p for p in self._pools if p is not None).impl

    # ------------------------------------------------------------ PagedKVCache's interface

    @property
    def num_layers(self) -> int:
        """``L``, every group's layers."""
        return len(self._where)

    @property
    def num_blocks(self) -> int:
        """Blocks of the full group: the ids a block table may hold."""
        return self._nb

    @property
    def block_size(self) -> int:
        """``P``."""
        return self._P

    @property
    def pad_slot(self) -> int:
        """``NB * P``: where padded rows write (each group's scratch block)."""
        return self._nb * self._P

    @property
    def num_kv_heads(self) -> int:
        """``Hkv``."""
        return self._heads

    @property
    def head_dim(self) -> int:
        """``D``."""
        return self._dim

    @property
    def dtype(self) -> torch.dtype:
        """Element type of the stored K/V."""
        return self._dtype

    @property
    def device(self) -> torch.device:
        """Where the pools live."""
        return self._device

    @property
    def impl(self) -> Literal["ref", "triton"]:
        """The write/copy implementation chosen at construction."""
        return self._impl

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block of every model layer as the KV tiers store it: ``[L, 2, P, Hkv, D]``,
        layers in model order (what a pool without groups would hold; each sliding layer's
        rows are its group's block for the full block)."""
        return (self.num_layers, 2, self._P, self._heads, self._dim)

    def pool_of_layer(self, layer: int) -> tuple[int, PagedKVCache | None, int]:
        """``(group, pool, index in the pool)`` of model layer ``layer``."""
        g, local = self._where[layer]
        return g, self._pools[g], local

    def pool(self, group: int) -> PagedKVCache | None:
        """The pool of ``group`` (``None`` for a full group without layers)."""
        return self._pools[group]

    def _layer(self, layer: int) -> tuple[PagedKVCache, int]:
        g, local = self._where[layer]
        pool = self._pools[g]
        assert pool is not None
        return pool, local

    def key_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s keys ``[NB_g, P, Hkv, D]`` in its group's pool (a view)."""
        pool, local = self._layer(layer)
        return pool.key_cache(local)

    def value_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s values ``[NB_g, P, Hkv, D]`` in its group's pool (a view)."""
        pool, local = self._layer(layer)
        return pool.value_cache(local)

    def slot_caches(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V with its group's scratch block (views)."""
        pool, local = self._layer(layer)
        return pool.slot_caches(local)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store one layer's new K/V at ``slot_mapping`` — the slots of the layer's group, as
        :meth:`group_tables` gives them. Raises InvariantError on shapes."""
        pool, local = self._layer(layer)
        pool.write(local, key, value, slot_mapping)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write of full-group blocks ``(src, dst)``: in the full group's pool, and in
        each sliding group for the pairs whose both blocks it holds (call after
        :meth:`apply_table_updates` of the same round).

        Raises:
            InvariantError: as :meth:`PagedKVCache.copy_blocks`.
        """
        if not pairs:
            return
        full = self._pools[0]
        if full is not None:
            full.copy_blocks(pairs)
        for g, host in self._host.items():
            mapped = [(host[s], host[d]) for s, d in pairs if s in host and d in host]
            pool = self._pools[g]
            if mapped and pool is not None:
                pool.copy_blocks(mapped)

    def copy_scratch(self) -> None:
        """Warm up every pool's copy op (copies nothing)."""
        for pool in self._pools:
            if pool is not None:
                pool.copy_scratch()

    def nbytes(self) -> int:
        """Bytes of every pool (scratch blocks not counted)."""
        return sum(p.num_blocks * PagedKVCache.bytes_per_block(p.num_layers, self._P, self._heads, self._dim,
                                                               self._dtype)
                   for p in self._pools if p is not None)

    # ------------------------------------------------------------ the groups' maps

    def apply_table_updates(self, updates: Sequence[tuple[int, int, int]]) -> None:
        """Set ``(group, full_block, group_block)`` mappings on the device (in place: a
        captured graph keeps reading the same map) and in the host mirror. Called by the
        runner before the forward of the round whose plan carries them.

        Raises:
            InvariantError: an unknown group or a block out of range.
        """
        by_group: dict[int, tuple[list[int], list[int]]] = {}
        for g, full, own in updates:
            pool = self._pools[g] if 0 < g < len(self._pools) else None
            if g not in self._maps or pool is None or not 0 <= full < self._nb or not 0 <= own < pool.num_blocks:
                raise InvariantError(f"table update {(g, full, own)} out of range")
            self._host[g][full] = own
            keys, values = by_group.setdefault(g, ([], []))
            keys.append(full)
            values.append(own)
        for g, (keys, values) in by_group.items():
            ids = to_device(keys + values, torch.int64, self._device)
            self._maps[g].index_put_((ids[: len(keys)],), ids[len(keys):])

    @property
    def group_of_layer(self) -> tuple[int, ...]:
        """The cache group of each model layer (0: full attention)."""
        return self.layout.group_of_layer

    def group_tables(self, slot_mapping: torch.Tensor,
                     block_tables: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Per sliding group, ``(slot_mapping, block_tables)`` translated through its map:
        ``[T]`` int64 slots and ``[R, W]`` int64 blocks of the group's pool (one device
        gather each, no host sync; inside a captured graph too). Called by the model once
        per forward (``models.layer_attention``)."""
        P = self._P
        out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for g, table in self._maps.items():
            slots = table[torch.div(slot_mapping, P, rounding_mode="floor")] * P + slot_mapping % P
            out[g] = (slots, table[block_tables.long()])
        return out


KVStorage = PagedKVCache | HybridKVCache
"""The engine's K/V storage: one pool, or one per cache group."""
