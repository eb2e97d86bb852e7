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
from deepinfer_kit.eplb.steps import window_sum
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
    num_experts = logcnt.shape[1]
    cnt = logcnt.double()
    item_mu = (load.double() / cnt).gather(1, phy2log).view(rows, per, width)
    expert = phy2log.reshape(rows, per, width).clone()
    # With risk 0 the variance terms add exactly 0.0, so they are skipped (same result).
    swapped = [expert, item_mu]
    if risk != 0.0:
        var = torch.zeros_like(load, dtype=torch.float64) if variance is None else variance.double()
        swapped.append((var / cnt**2).gather(1, phy2log).view(rows, per, width))
    row = torch.arange(rows)
    first_gpu = row * per
    gpu_key = torch.arange(per) * num_experts  # [per]: GPU b's keys are b*E + expert
    slot_key = gpu_key.repeat_interleave(width)  # [per * S]
    for _ in range(max_swaps):
        mu = item_mu.sum(-1)  # [X, per]
        if risk == 0.0:
            top, a = mu.max(dim=1)
        else:
            va = swapped[2].sum(-1)
            top, a = (mu + risk * va.sqrt()).max(dim=1)
        at_a = first_gpu + a
        ea = expert.view(-1, width).index_select(0, at_a)  # [X, S]
        dmu = item_mu.view(-1, width).index_select(0, at_a)[:, :, None, None] - item_mu[:, None]  # [X, S, per, S]
        if risk == 0.0:  # i leaves a, j joins a
            pair = torch.maximum(top[:, None, None, None] - dmu, dmu.add_(mu[:, None, :, None]))
        else:
            item_var = swapped[2]
            dva = item_var.view(-1, width).index_select(0, at_a)[:, :, None, None] - item_var[:, None]
            va_a = va.gather(1, a[:, None])[:, :, None, None]
            new_a = mu.gather(1, a[:, None])[:, :, None, None] - dmu + risk * (va_a - dva).clamp_min(0).sqrt()
            new_b = mu[:, None, :, None] + dmu + risk * (va[:, None, :, None] + dva).clamp_min(0).sqrt()
            pair = torch.maximum(new_a, new_b)
        # No swap may put a second replica of an expert on a GPU, nor pair a with itself.
        held = torch.zeros(rows, per * num_experts, dtype=torch.bool)
        held.scatter_(1, slot_key + expert.view(rows, -1), True)
        banned_b = held.gather(1, (ea[:, :, None] + gpu_key).view(rows, -1)).view(rows, width, per)
        banned_b.scatter_(2, a[:, None, None].expand(rows, width, 1), True)
        a_has_j = held.gather(1, a[:, None] * num_experts + expert.view(rows, -1)).view(rows, 1, per, width)
        pair.masked_fill_(banned_b[..., None], torch.inf).masked_fill_(a_has_j, torch.inf)
        best, flat = pair.view(rows, -1).min(dim=1)
        act = best < top * (1 - 1e-9)
        if not bool(act.any()):
            break
        r, f = row[act], flat[act]
        i, b, j = f // (per * width), (f // width) % per, f % width
        pos_a, pos_b = (at_a[act] * width) + i, (first_gpu[r] + b) * width + j
        for t in swapped:
            flat_t = t.view(-1)
            held_a = flat_t[pos_a]
            flat_t[pos_a] = flat_t[pos_b]
            flat_t[pos_b] = held_a
    return expert.view(layers, slots)


class RefinedPlacementPolicy:
    """DeepSeek's three steps (its greedy packing), then :func:`refine_swaps`, on the
    window's total.

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
        """See :meth:`PlacementPolicy.place`: plans from the window's total (``load``
        ``[S, L, E]`` summed over its steps)."""
        return plan_refined(window_sum(load), topology, self._mode, max_swaps=self._max_swaps)


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
