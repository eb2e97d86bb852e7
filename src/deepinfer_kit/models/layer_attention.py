"""Each layer's attention metadata when the KV store keeps layer groups (full attention and
sliding windows in pools of their own, ``cache.hybrid_kv.HybridKVCache``)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import attrs
import torch

from deepinfer_kit.models.records import AttentionMetadata

__all__ = ["GroupedKVStore", "attention_by_layer"]


@runtime_checkable
class GroupedKVStore(Protocol):
    """A KV store whose layers fall into groups with block ids of their own: the members a
    model reads besides :class:`~deepinfer_kit.models.protocols.PagedKVStore`'s."""

    @property
    def group_of_layer(self) -> tuple[int, ...]:
        """The group of each model layer (0: the group the step's block tables name)."""
        ...

    def group_tables(self, slot_mapping: torch.Tensor,
                     block_tables: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Per group other than 0, the step's ``(slot_mapping [T], block_tables [R, W])``
        in that group's block ids (device tensors, no host sync)."""
        ...


def attention_by_layer(kv_cache: object, attn: AttentionMetadata, num_layers: int) -> list[AttentionMetadata]:
    """The attention metadata of each of the first ``num_layers`` layers: ``attn`` itself
    for a store without groups (every layer), else ``attn`` with the layer's group's slot
    mapping and block tables. Called once per forward, before the first layer."""
    if not isinstance(kv_cache, GroupedKVStore):
        return [attn] * num_layers
    per_group: dict[int, AttentionMetadata] = {0: attn}
    for g, (slots, tables) in kv_cache.group_tables(attn.slot_mapping, attn.block_tables).items():
        per_group[g] = attrs.evolve(attn, slot_mapping=slots, block_tables=tables)
    return [per_group[g] for g in kv_cache.group_of_layer[:num_layers]]
