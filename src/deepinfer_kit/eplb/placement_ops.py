"""Placement helpers: topology validation, building a Placement, GPU loads under one.

Shape symbols: ``L`` layers, ``E`` logical experts, ``P`` physical slots per layer,
``G`` GPUs, ``R`` most replicas of one expert.
"""

from __future__ import annotations

from typing import Literal

import torch

from deepinfer_kit.eplb.records import Placement, Topology
from deepinfer_kit.errors import ConfigError

__all__ = ["validate_topology", "placement_from_ranks", "placement_from_phy2log", "gpu_loads"]


def validate_topology(
    load: torch.Tensor, topology: Topology, mode: Literal["hierarchical", "global"] = "global"
) -> None:
    """Raise :class:`ConfigError` naming the field when ``load`` cannot be placed on ``topology``.

    Args:
        load: ``[L, E]``.
        topology: the cluster.
        mode: ``"hierarchical"`` also needs groups dividing the experts and nodes dividing
            the groups.
    """
    if load.dim() != 2 or load.shape[1] < 1:
        raise ConfigError(f"load must be [L, E] with E >= 1, got shape {tuple(load.shape)}")
    if load.is_floating_point() and not bool(torch.isfinite(load).all()):
        raise ConfigError("load must be finite")
    if bool((load < 0).any()):
        raise ConfigError(f"load must be >= 0, got min {float(load.min())}")
    experts = load.shape[1]
    slots, gpus, nodes = topology.num_physical_experts, topology.num_gpus, topology.num_nodes
    if slots < experts:
        raise ConfigError(f"num_physical_experts must be >= the {experts} experts, got {slots}")
    if slots % gpus:
        raise ConfigError(f"num_physical_experts must be divisible by num_gpus={gpus}, got {slots}")
    if gpus % nodes:
        raise ConfigError(f"num_gpus must be divisible by num_nodes={nodes}, got {gpus}")
    if mode == "hierarchical":
        groups = topology.num_groups
        if experts % groups:
            raise ConfigError(f"num_groups must divide the {experts} experts, got {groups}")
        if groups % nodes:
            raise ConfigError(f"num_groups must be divisible by num_nodes={nodes}, got {groups}")


def placement_from_ranks(phy2log: torch.Tensor, phyrank: torch.Tensor, logcnt: torch.Tensor) -> Placement:
    """Build a :class:`Placement` from the slot map and each slot's replica rank.

    Args:
        phy2log: ``[L, P]`` int64.
        phyrank: ``[L, P]`` int64, replica ``r`` of its expert goes to ``log2phy[..., r]``.
        logcnt: ``[L, E]`` int64.
    """
    layers, slots = phy2log.shape
    width = int(logcnt.max())
    log2phy = torch.full((layers, logcnt.shape[1] * width), -1, dtype=torch.int64)
    log2phy.scatter_(1, phy2log * width + phyrank, torch.arange(slots).expand(layers, slots))
    return Placement(phy2log=phy2log, log2phy=log2phy.view(layers, -1, width), logcnt=logcnt)


def placement_from_phy2log(phy2log: torch.Tensor, num_experts: int) -> Placement:
    """Build a :class:`Placement` from ``phy2log`` (``[L, P]`` int64) alone; replicas are
    ranked by slot order."""
    layers, slots = phy2log.shape
    logcnt = torch.zeros(layers, num_experts, dtype=torch.int64).scatter_add_(
        1, phy2log, torch.ones_like(phy2log)
    )
    # A stable sort groups each expert's slots in slot order; a replica's rank is its
    # position after the first sorted slot of its expert.
    order = torch.argsort(phy2log, dim=1, stable=True)
    first = (logcnt.cumsum(1) - logcnt).gather(1, phy2log.gather(1, order))
    phyrank = torch.empty_like(order).scatter_(1, order, torch.arange(slots) - first)
    return placement_from_ranks(phy2log, phyrank, logcnt)


def gpu_loads(placement: Placement, load: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """``[..., L, G]`` float64 load on each GPU: each expert's load split evenly over its replicas.

    Args:
        placement: the placement (``phy2log`` ``[L, P]``, ``logcnt`` ``[L, E]``).
        load: ``[..., L, E]`` load per logical expert (a window's total ``[L, E]``, or
            per-step counts ``[S, L, E]``).
        num_gpus: ``G``, dividing ``P``.
    """
    per_replica = load.double() / placement.logcnt.double()
    index = placement.phy2log.expand(*load.shape[:-2], *placement.phy2log.shape)
    slot_load = per_replica.gather(-1, index)
    return slot_load.view(*slot_load.shape[:-1], num_gpus, -1).sum(-1)
