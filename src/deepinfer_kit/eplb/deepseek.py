"""DeepSeek's EPLB placement: hierarchical (groups to nodes) and global policies.

The algorithm of deepseek-ai/EPLB, re-derived from its description and README example:

1. pack the expert groups onto nodes so node loads are balanced (hierarchical only);
2. inside each node, give the node's spare slots one at a time to the expert with the
   highest load per replica;
3. pack each node's physical experts onto its GPUs so GPU loads are balanced.

Shape symbols: ``L`` layers, ``E`` logical experts, ``P`` physical slots per layer,
``N`` nodes, ``G`` GPUs, ``R`` most replicas of one expert.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import torch

from deepinfer_kit.eplb.packing import greedy_pack, replicate, spread_replicas
from deepinfer_kit.eplb.placement_ops import placement_from_ranks, validate_topology
from deepinfer_kit.eplb.records import Placement, Topology
from deepinfer_kit.eplb.steps import window_sum

__all__ = ["Packer", "plan_placement", "HierarchicalPlacementPolicy", "GlobalPlacementPolicy"]

Packer = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
"""``packer(weight [X, n], num_packs) -> (pack [X, n], rank [X, n])``, e.g. ``greedy_pack``."""


def plan_placement(
    load: torch.Tensor,
    topology: Topology,
    mode: Literal["hierarchical", "global"],
    packer: Packer = greedy_pack,
    spread: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 1-3 above, batched over layers and nodes.

    Args:
        load: ``[L, E]`` load per logical expert (CPU, any real dtype).
        topology: slots, groups, nodes, GPUs. ``"global"`` uses one group and one node.
        mode: which DeepSeek policy.
        packer: the packing used for groups and GPUs (:func:`greedy_pack` is DeepSeek's).
        spread: swap replicas of one expert apart when a GPU got two of them
            (:func:`spread_replicas`); off reproduces DeepSeek's packing as is.

    Returns:
        ``(phy2log, phyrank, logcnt)``: ``[L, P]`` int64 logical expert per slot (slots of
        GPU ``g`` are ``[g*P/G, (g+1)*P/G)``), ``[L, P]`` int64 replica rank of each slot,
        ``[L, E]`` int64 replicas per expert.

    Raises:
        ConfigError: the topology does not divide (see :func:`validate_topology`).
    """
    validate_topology(load, topology, mode)
    layers, experts = load.shape
    slots, gpus = topology.num_physical_experts, topology.num_gpus
    groups, nodes = (topology.num_groups, topology.num_nodes) if mode == "hierarchical" else (1, 1)
    group_size, per_node = experts // groups, experts // nodes
    weight = load.float()
    # 1. groups -> nodes; mlog ("meta-logical") numbers experts node by node.
    group_load = weight.view(layers, groups, group_size).sum(-1)
    gpack, grank = packer(group_load, nodes)
    first = (gpack * (groups // nodes) + grank) * group_size
    log2mlog = (first[:, :, None] + torch.arange(group_size)).reshape(layers, experts)
    mlog2log = torch.empty_like(log2mlog).scatter_(1, log2mlog, torch.arange(experts).expand(layers, experts))
    # 2. replicate inside each node: rows are (layer, node).
    node_load = weight.gather(1, mlog2log).view(layers * nodes, per_node)
    phy2mlog, phyrank, mlogcnt = replicate(node_load, slots // nodes)
    # 3. physical experts -> GPUs of the node.
    phy_load = (node_load / mlogcnt).gather(1, phy2mlog)
    pack, rank = packer(phy_load, gpus // nodes)
    if spread:
        pack, rank = spread_replicas(pack, rank, phy_load, phy2mlog, gpus // nodes)
    slot_in_node = pack * (slots // gpus) + rank
    node_slot2phy = torch.empty_like(slot_in_node).scatter_(
        1, slot_in_node, torch.arange(slots // nodes).expand_as(slot_in_node)
    )
    mlog = phy2mlog.gather(1, node_slot2phy).view(layers, nodes, -1)
    mlog = (mlog + torch.arange(nodes)[None, :, None] * per_node).view(layers, slots)
    phy2log = mlog2log.gather(1, mlog)
    ranks = phyrank.gather(1, node_slot2phy).view(layers, slots)
    logcnt = mlogcnt.view(layers, experts).gather(1, log2mlog)
    return phy2log, ranks, logcnt


class HierarchicalPlacementPolicy:
    """DeepSeek's hierarchical policy: groups packed onto nodes, replicas kept in their node.

    Plans from the window's total (the sum of its steps). Falls back to the global policy when the groups do not divide over the nodes, as
    DeepSeek's ``rebalance_experts`` does. Stateless.

    Args:
        spread: repair GPUs holding two replicas of one expert (default on; the README
            example is unaffected).
    """

    def __init__(self, spread: bool = True) -> None:
        self._spread = spread

    def place(self, load: torch.Tensor, topology: Topology) -> Placement:
        """See :meth:`PlacementPolicy.place`: plans from the window's total (``load``
        ``[S, L, E]`` summed over its steps). CPU only; does not mutate ``load``."""
        mode: Literal["hierarchical", "global"] = (
            "hierarchical" if topology.num_groups % topology.num_nodes == 0 else "global"
        )
        total = window_sum(load)
        return placement_from_ranks(*plan_placement(total, topology, mode, greedy_pack, self._spread))


class GlobalPlacementPolicy:
    """DeepSeek's global policy: replicate over all slots ignoring groups, pack onto GPUs.

    Plans from the window's total (the sum of its steps).

    Args:
        spread: as in :class:`HierarchicalPlacementPolicy`.
    """

    def __init__(self, spread: bool = True) -> None:
        self._spread = spread

    def place(self, load: torch.Tensor, topology: Topology) -> Placement:
        """See :meth:`PlacementPolicy.place`: plans from the window's total. CPU only; does
        not mutate ``load``."""
        total = window_sum(load)
        return placement_from_ranks(*plan_placement(total, topology, "global", greedy_pack, self._spread))


if TYPE_CHECKING:
    from deepinfer_kit.eplb.protocols import PlacementPolicy

    _check_h: type[PlacementPolicy] = HierarchicalPlacementPolicy
    _check_g: type[PlacementPolicy] = GlobalPlacementPolicy
