"""Per-batch balancedness: a placement and a replica selector judged on each batch's own routing.

Shape symbols: ``L`` layers, ``E`` logical experts, ``P`` slots, ``G`` GPUs, ``B`` tokens
of a batch, ``k`` experts per token.

A placement planned from past windows fixes which GPUs hold each expert's replicas; the
selector then splits each batch's copies over them. The balancedness of a batch is
``mean / max`` GPU load of that batch (1 is perfect), per layer. A window's steps
``[S, L, E]`` are judged the same way, one batch per step (:func:`even_split_balancedness`,
:func:`quota_balancedness`).
"""

from __future__ import annotations

import torch

from deepinfer_kit.eplb.evaluate import balancedness
from deepinfer_kit.eplb.placement_ops import gpu_loads
from deepinfer_kit.eplb.records import Placement
from deepinfer_kit.moe.protocols import ReplicaSelector
from deepinfer_kit.moe.replica_layout import ReplicaLayout
from deepinfer_kit.moe.selectors import BalancedSelector, EvenSelector, gpu_load_of

__all__ = ["sample_batch", "batch_balancedness", "layouts_of", "even_split_balancedness", "quota_balancedness"]


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
    """``[..., L]`` float64 mean / max GPU load when every expert's ``counts`` (``[..., L, E]``:
    one batch or window ``[L, E]``, or a window's steps ``[S, L, E]``) are split in exactly
    equal fractional shares over its replicas (what a placement policy assumes when it
    plans); 1 for an idle layer."""
    return balancedness(gpu_loads(placement, counts, num_gpus))


def quota_balancedness(
    counts: torch.Tensor, placement: Placement, num_gpus: int, selector: EvenSelector | BalancedSelector
) -> torch.Tensor:
    """``[..., L]`` float64 mean / max GPU load of each batch of ``counts`` (``[..., L, E]``
    copies per expert: one batch ``[L, E]``, or a window's steps ``[S, L, E]``, each step
    one batch) when ``selector`` splits it over ``placement``'s replicas: the integer
    quotas a count-based selector dispatches (what :func:`batch_balancedness` measures,
    without drawing the copies). 1 for an idle layer. One selector call per batch and layer."""
    layouts = layouts_of(placement, num_gpus)
    flat = counts.reshape(-1, counts.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float64)
    for i, row in enumerate(flat):
        layout = layouts[i % len(layouts)]
        load = gpu_load_of(selector.quotas(row, layout), layout)
        out[i] = balancedness(load)
    return out.view(counts.shape[:-1])
