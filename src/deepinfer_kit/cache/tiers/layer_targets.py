"""layer_targets: where each model layer's rows of one round's tier transfers live on the
device — the pool, the layer's index in it, and the blocks — for a pool without groups
(every layer, the plan's blocks) and for a hybrid cache (a sliding layer's rows go to its
group's blocks, and only for the blocks its group holds)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import torch

from deepinfer_kit._staging import to_device
from deepinfer_kit.cache.hybrid_kv import HybridKVCache, KVStorage
from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.errors import InvariantError

__all__ = ["LayerTarget", "layer_targets"]


@attrs.frozen(slots=True, eq=False)
class LayerTarget:
    """One model layer's share of a transfer of ``n`` blocks.

    Attributes:
        pool: the pool holding the layer (``None``: nothing to move for this layer).
        local: the layer's index in ``pool``.
        rows: which of the ``n`` blocks this layer moves, int64 ``[k]`` on the pool's
            device (``None``: all ``n``, in order).
        blocks: ``pool``'s block for each moved row, int64 ``[k]`` on the pool's device.
    """

    pool: PagedKVCache | None
    local: int
    rows: torch.Tensor | None
    blocks: torch.Tensor

    def pick(self, data: torch.Tensor) -> torch.Tensor:
        """The rows of ``data`` (``[n, ...]``, on the pool's device) this layer moves."""
        return data if self.rows is None else data.index_select(0, self.rows)


def layer_targets(kv: KVStorage, blocks: Sequence[int], groups: Mapping[int, Sequence[int]]) -> list[LayerTarget]:
    """Per model layer, where the rows of a transfer of ``blocks`` (full-group block ids)
    are: every layer of a :class:`PagedKVCache` at ``blocks``; a hybrid cache's
    full-attention layers at ``blocks`` and each sliding layer at its group's blocks
    ``groups[g]`` (aligned with ``blocks``; ``-1`` skips a row). Index tensors go to the
    pool's device once per group. Called by the device side per round with transfers.

    Raises:
        InvariantError: a hybrid cache and a sliding group missing from ``groups`` or of
            another length than ``blocks``.
    """
    dev = kv.device
    full = to_device(list(blocks), torch.int64, dev)
    if not isinstance(kv, HybridKVCache):
        return [LayerTarget(kv, layer, None, full) for layer in range(kv.num_layers)]
    per_group: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {0: (None, full)}
    out: list[LayerTarget] = []
    for layer in range(kv.num_layers):
        g, pool, local = kv.pool_of_layer(layer)
        if g not in per_group:
            own = groups.get(g)
            if own is None or len(own) != len(blocks):
                raise InvariantError(f"tier transfer of {len(blocks)} blocks: sliding group {g} gives "
                                     f"{None if own is None else len(own)} blocks of its own")
            rows = [i for i, b in enumerate(own) if b >= 0]
            picked = to_device(rows + [own[i] for i in rows], torch.int64, dev)
            per_group[g] = (None if len(rows) == len(own) else picked[:len(rows)], picked[len(rows):])
        rows_t, ids = per_group[g]
        out.append(LayerTarget(pool if ids.numel() else None, local, rows_t, ids))
    return out
