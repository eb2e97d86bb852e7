"""Per-batch balancedness: a placement and a replica selector judged on each batch's own routing.

Shape symbols: ``L`` layers, ``E`` logical experts, ``P`` slots, ``G`` GPUs, ``B`` tokens
of a batch, ``k`` experts per token.

A placement planned from past windows fixes which GPUs hold each expert's replicas; the
selector then splits each batch's copies over them. The balancedness of a batch is
``mean / max`` GPU load of that batch (1 is perfect), per layer.
"""

from __future__ import annotations

import torch

from deepinfer_kit.eplb.records import Placement
from deepinfer_kit.moe.protocols import ReplicaSelector
from deepinfer_kit.moe.replica_layout import ReplicaLayout
from deepinfer_kit.moe.selectors import gpu_load_of

__all__ = ["sample_batch", "batch_balancedness", "layouts_of", "even_split_balancedness"]


def sample_batch(popularity: torch.Tensor, tokens: int, top_k: int, generator: torch.Generator) -> torch.Tensor:
    """``[L, B * k]`` int64 routed ids: each of ``tokens`` tokens picks ``top_k`` distinct
    experts per layer with probability proportional to ``popularity`` (``[L, E]``, >= 0,
    each row with at least ``top_k`` positive entries), flattened token-major like a
    router's ``[B, k]`` ids."""
    rows = []
    for p in popularity.double():
        probs = (p + 1e-12).expand(tokens, -1)
        rows.append(torch.multinomial(probs, top_k, replacement=False, generator=generator).reshape(-1))
    return torch.stack(rows)


def layouts_of(placement: Placement, num_gpus: int) -> list[ReplicaLayout]:
    """One :class:`ReplicaLayout` per layer of ``placement`` over ``num_gpus`` GPUs."""
    experts = int(placement.logcnt.shape[1])
    return [ReplicaLayout(row, experts, num_gpus) for row in placement.phy2log.tolist()]


def batch_balancedness(ids: torch.Tensor, layouts: list[ReplicaLayout], selector: ReplicaSelector) -> torch.Tensor:
    """``[L]`` float64 mean / max GPU load of one batch (``ids``: ``[L, N]``) when
    ``selector`` splits it over each layer's replicas (one rank: ``counts`` is ``[1, E]``)."""
    out = []
    for row, layout in zip(ids, layouts):
        counts = torch.bincount(row, minlength=layout.num_experts)[None]
        slots = selector.select(row, counts, 0, layout).slots
        load = gpu_load_of(torch.bincount(slots, minlength=layout.num_slots), layout).double()
        out.append(load.mean() / load.max())
    return torch.stack(out)


def even_split_balancedness(counts: torch.Tensor, placement: Placement, num_gpus: int) -> torch.Tensor:
    """``[L]`` float64 mean / max GPU load when every expert's ``counts`` (``[L, E]``) are
    split in exactly equal fractional shares over its replicas (what a placement policy
    assumes when it plans)."""
    per_replica = counts.double() / placement.logcnt.double()
    load = per_replica.gather(1, placement.phy2log).view(counts.shape[0], num_gpus, -1).sum(-1)
    return load.mean(1) / load.max(1).values
