"""Swap refinement: exchange replicas between the most loaded GPU and another while its
(risk-adjusted) load falls, plus the policy that refines DeepSeek-style plans.

Shape symbols: ``L`` layers, ``E`` logical experts, ``P`` slots per layer, ``G`` GPUs,
``D`` swap domains (nodes for the hierarchical policy, else 1), ``S = P / G`` slots per GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch

from deepinfer_kit.eplb.deepseek import plan_placement
from deepinfer_kit.eplb.packing import greedy_pack
from deepinfer_kit.eplb.placement_ops import placement_from_phy2log
from deepinfer_kit.eplb.records import Placement, Topology
from deepinfer_kit.errors import ConfigError

__all__ = ["refine_swaps", "plan_refined", "RefinedPlacementPolicy"]


def refine_swaps(
    phy2log: torch.Tensor,
    logcnt: torch.Tensor,
    load: torch.Tensor,
    num_gpus: int,
    num_domains: int = 1,
    *,
    variance: torch.Tensor | None = None,
    risk: float = 0.0,
    max_swaps: int = 6,
) -> torch.Tensor:
    """Lower the highest GPU score by swapping replicas, all rows at once.

    A GPU's score is ``mean + risk * sqrt(var)``: the sum of its replicas' loads (an
    expert's load split evenly over its replicas) plus ``risk`` standard deviations of it
    (replica variance ``variance / logcnt**2``). Each round, in every (layer, domain) row,
    the best swap between the top-scoring GPU and any other GPU of the domain is applied if
    it lowers the pair's higher score below the top; a swap never puts two replicas of one
    expert on one GPU. Replica counts and slots per GPU never change.

    Args:
        phy2log: ``[L, P]`` int64 (GPU ``g`` holds slots ``[g*S, (g+1)*S)``); not mutated.
        logcnt: ``[L, E]`` int64 replicas per expert.
        load: ``[L, E]`` expected load per expert.
        num_gpus: ``G``; ``num_domains`` must divide it (GPUs ``d*G/D ..`` form domain ``d``).
        variance: ``[L, E]`` variance of each expert's load; ``None`` means 0.
        risk: the ``risk`` weight above, ``>= 0``.
        max_swaps: rounds at most.

    Returns:
        ``[L, P]`` int64, the refined ``phy2log``.
    """
    layers, slots = phy2log.shape
    rows, per, width = layers * num_domains, num_gpus // num_domains, slots // num_gpus
    cnt = logcnt.double()
    item_mu = (load.double() / cnt).gather(1, phy2log).view(rows, per, width)
    var = torch.zeros_like(load, dtype=torch.float64) if variance is None else variance.double()
    item_var = (var / cnt**2).gather(1, phy2log).view(rows, per, width)
    expert = phy2log.reshape(rows, per, width).clone()
    row = torch.arange(rows)
    gpu_ids = torch.arange(per)
    for _ in range(max_swaps):
        mu, va = item_mu.sum(-1), item_var.sum(-1)
        score = mu + risk * va.sqrt()
        top, a = score.max(dim=1)
        ea, mua, vaa = expert[row, a], item_mu[row, a], item_var[row, a]  # [X, S]
        dmu = mua[:, :, None, None] - item_mu[:, None]  # [X, S, per, S]: i leaves a, j joins a
        dva = vaa[:, :, None, None] - item_var[:, None]
        new_a = mu[row, a][:, None, None, None] - dmu + risk * (va[row, a][:, None, None, None] - dva).clamp_min(0).sqrt()
        new_b = mu[:, None, :, None] + dmu + risk * (va[:, None, :, None] + dva).clamp_min(0).sqrt()
        pair = torch.maximum(new_a, new_b)
        b_has_i = (expert[:, None, :, :] == ea[:, :, None, None]).any(-1)  # [X, S, per]
        a_has_j = (expert[:, :, :, None] == ea[:, None, None, :]).any(-1)  # [X, per, S]
        ok = ~b_has_i[..., None] & ~a_has_j[:, None] & (gpu_ids != a[:, None])[:, None, :, None]
        pair = torch.where(ok, pair, torch.inf).view(rows, -1)
        best, flat = pair.min(dim=1)
        act = best < top * (1 - 1e-9)
        if not bool(act.any()):
            break
        r, aa = row[act], a[act]
        i, b, j = flat[act] // (per * width), (flat[act] // width) % per, flat[act] % width
        for t in (expert, item_mu, item_var):
            held = t[r, aa, i].clone()
            t[r, aa, i] = t[r, b, j]
            t[r, b, j] = held
    return expert.view(layers, slots)


class RefinedPlacementPolicy:
    """DeepSeek's three steps (its greedy packing), then :func:`refine_swaps`.

    Args:
        mode: ``"hierarchical"`` (swaps stay inside a node; falls back to global when the
            groups do not divide over the nodes) or ``"global"``.
        max_swaps: refinement rounds at most.

    Stateless; ``place`` returns a CPU placement and mutates nothing.
    """

    def __init__(self, mode: Literal["hierarchical", "global"] = "hierarchical", max_swaps: int = 6) -> None:
        if mode not in ("hierarchical", "global"):
            raise ConfigError(f"mode must be 'hierarchical' or 'global', got {mode!r}")
        self._mode: Literal["hierarchical", "global"] = mode
        self._max_swaps = max_swaps

    def place(self, load: torch.Tensor, topology: Topology) -> Placement:
        """See :meth:`PlacementPolicy.place`."""
        return plan_refined(load, topology, self._mode, max_swaps=self._max_swaps)


def plan_refined(
    load: torch.Tensor,
    topology: Topology,
    mode: Literal["hierarchical", "global"],
    *,
    variance: torch.Tensor | None = None,
    risk: float = 0.0,
    max_swaps: int = 6,
) -> Placement:
    """DeepSeek's plan of ``load`` (``[L, E]``) refined by :func:`refine_swaps`.

    Raises:
        ConfigError: the topology does not divide.
    """
    if mode == "hierarchical" and topology.num_groups % topology.num_nodes:
        mode = "global"
    phy2log, _, logcnt = plan_placement(load, topology, mode, greedy_pack)
    domains = topology.num_nodes if mode == "hierarchical" else 1
    refined = refine_swaps(
        phy2log, logcnt, load, topology.num_gpus, domains, variance=variance, risk=risk, max_swaps=max_swaps
    )
    return placement_from_phy2log(refined, load.shape[1])


if TYPE_CHECKING:
    from deepinfer_kit.eplb.protocols import PlacementPolicy

    _check: type[PlacementPolicy] = RefinedPlacementPolicy
