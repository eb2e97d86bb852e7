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
    def pad_slot(self) -> int:
        """The slot whose writes no attention reads (group 0's; each group maps it to its
        own scratch block)."""
        ...

    @property
    def group_of_layer(self) -> tuple[int, ...]:
        """The group of each model layer (0: the group the step's block tables name)."""
        ...

    def group_tables(self, slot_mapping: torch.Tensor,
                     block_tables: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Per group other than 0, the step's ``(slot_mapping [T], block_tables [R, W])``
        in that group's block ids (device tensors, no host sync)."""
        ...


def attention_by_layer(kv_cache: object, attn: AttentionMetadata, num_layers: int,
                       shared_rows: torch.Tensor | None = None) -> list[AttentionMetadata]:
    """The attention metadata of each of the first ``num_layers`` layers: ``attn`` itself
    for a store without groups (every layer), else ``attn`` with the layer's group's slot
    mapping and block tables. ``shared_rows`` (``ForwardBatch.shared_rows``): group 0's
    slots of those rows go to the pad slot (their K/V is cached; the other groups still
    write theirs). Called once per forward, before the first layer."""
    full = attn
    if shared_rows is not None:
        pad = int(getattr(kv_cache, "pad_slot"))
        full = attrs.evolve(attn, slot_mapping=attn.slot_mapping.index_fill(0, shared_rows, pad))
    if not isinstance(kv_cache, GroupedKVStore):
        return [full] * num_layers
    per_group: dict[int, AttentionMetadata] = {0: full}
    for g, (slots, tables) in kv_cache.group_tables(attn.slot_mapping, attn.block_tables).items():
        per_group[g] = attrs.evolve(attn, slot_mapping=slots, block_tables=tables)
    return [per_group[g] for g in kv_cache.group_of_layer[:num_layers]]
