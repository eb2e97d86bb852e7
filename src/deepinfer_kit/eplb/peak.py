"""PeakPlacementPolicy: plans against the window's per-step peaks, for the dispatch that runs.

A window's sum hides which experts are hot together: two experts hot in alternate steps
sum like two warm ones, and a GPU holding two experts hot in the same steps looks
balanced on the sum while it is the busiest GPU of every such step. This policy reads
the window's per-step counts ``[S, L, E]`` and

1. (hierarchical) packs the expert groups onto nodes, lowering the sum over steps of
   the busiest node;
2. replicates: each spare slot to the expert with the largest per-step load per replica
   (the window's highest single-replica peak falls first);
3. packs the replicas onto the GPUs (of their node), lowering the sum over steps of the
   busiest GPU (:func:`~deepinfer_kit.eplb.peak_ops.pack_steps`).

For ``dispatch="balanced"`` (the kit's :class:`~deepinfer_kit.moe.selectors.BalancedSelector`,
which moves a replicated expert's copies between its replicas every batch) step 3 also
spreads the replicated experts' replicas evenly over the GPUs: a GPU's load in a step is
then not fixed by the plan but levelled by the dispatcher wherever a replicated expert
links it to a lighter GPU, and a GPU without such a replica can neither shed nor take
load. For ``dispatch="even"`` (or ``"static"``) the replicas are packed as the even split
that will run. ``weighting="share"`` plans on each step's share of its layer's load (every
step weighs alike, as per-step balancedness judges them); ``"tokens"`` on raw counts
(a big step weighs more, as its time does).

Shape symbols: ``S`` steps, ``L`` layers, ``E`` experts, ``P`` slots, ``N`` nodes, ``G`` GPUs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch

from deepinfer_kit.eplb.peak_ops import pack_steps, replicate_by_peak
from deepinfer_kit.eplb.placement_ops import placement_from_phy2log, validate_topology
from deepinfer_kit.eplb.records import Placement, Topology
from deepinfer_kit.eplb.steps import check_steps
from deepinfer_kit.errors import ConfigError

__all__ = ["PeakPlacementPolicy", "plan_peak", "step_weights"]

Mode = Literal["hierarchical", "global"]
Dispatch = Literal["balanced", "even"]
Weighting = Literal["share", "tokens"]


def step_weights(load: torch.Tensor, weighting: Weighting = "share") -> torch.Tensor:
    """``[L, E, S]`` float64 (contiguous) what the planner balances: ``load``'s per-step
    counts (``[S, L, E]``, checked), divided by each step's layer total for ``"share"``
    (an idle step stays 0). A new tensor; ``load`` is not mutated."""
    w = load.permute(1, 2, 0).to(torch.float64, memory_format=torch.contiguous_format)
    if w.data_ptr() == load.data_ptr():
        w = w.clone()
    if weighting == "share":
        w.div_(w.sum(dim=1, keepdim=True).clamp_min(1e-300))
    return w


def plan_peak(
    load: torch.Tensor,
    topology: Topology,
    mode: Mode = "hierarchical",
    *,
    dispatch: Dispatch = "balanced",
    weighting: Weighting = "share",
) -> Placement:
    """Steps 1-3 of the module doc, batched over layers (and nodes).

    Args:
        load: ``[S, L, E]`` per-step counts (CPU; any integer or floating dtype).
        topology: the cluster. ``"hierarchical"`` keeps each group's replicas in one node;
            it falls back to ``"global"`` when the groups do not divide over the nodes.
        mode, dispatch, weighting: as :class:`PeakPlacementPolicy`.

    Returns:
        A CPU :class:`Placement`.

    Raises:
        ConfigError: a bad ``load`` (naming ``load`` and the shape or value) or a topology
            that does not divide (see :func:`validate_topology`).
    """
    check_steps(load)
    if mode == "hierarchical" and topology.num_groups % topology.num_nodes:
        mode = "global"
    validate_topology(load[0], topology, mode)
    layers, experts = load.shape[1], load.shape[2]
    slots, gpus = topology.num_physical_experts, topology.num_gpus
    spread = dispatch == "balanced"
    w = step_weights(load, weighting)
    if mode == "global" or topology.num_nodes == 1:
        count = replicate_by_peak(w, slots)
        return placement_from_phy2log(pack_steps(w, count, gpus, spread_replicated=spread), experts)
    nodes, groups = topology.num_nodes, topology.num_groups
    size, per_node = experts // groups, experts // nodes
    group_load = w.view(layers, groups, size, -1).sum(dim=2)
    group_at = pack_steps(group_load, torch.ones(layers, groups, dtype=torch.int64), nodes)  # [L, groups] by slot
    # mlog: experts renumbered node by node (each node's groups in its slot order)
    mlog2log = (group_at[:, :, None] * size + torch.arange(size)).reshape(layers, experts)
    rows = w.view(layers * experts, -1).index_select(0, (mlog2log + torch.arange(layers)[:, None] * experts).view(-1))
    node_rows = rows.view(layers * nodes, per_node, -1)
    count = replicate_by_peak(node_rows, slots // nodes)
    local = pack_steps(node_rows, count, gpus // nodes, spread_replicated=spread)  # [L*N, P/N]
    mlog = (local.view(layers, nodes, -1) + torch.arange(nodes)[None, :, None] * per_node).view(layers, slots)
    return placement_from_phy2log(mlog2log.gather(1, mlog), experts)


class PeakPlacementPolicy:
    """Plans from the window's per-step counts against per-step peaks (module doc).

    Stateless; ``place`` returns a CPU placement and mutates nothing. Compose with
    :class:`~deepinfer_kit.eplb.movement.MovementAwarePlacementPolicy` to keep replicas in
    their slots across rebalances.

    Args:
        mode: ``"hierarchical"`` (groups packed onto nodes, replicas kept in their node;
            global when the groups do not divide over the nodes) or ``"global"``.
        dispatch: the replica dispatch that will run: ``"balanced"`` (the kit's
            :class:`~deepinfer_kit.moe.selectors.BalancedSelector`) or ``"even"`` (an
            even split, or the static spread).
        weighting: ``"share"`` (each step's load as a share of its layer's: steps weigh
            alike) or ``"tokens"`` (raw counts).

    Raises:
        ConfigError: an unknown ``mode``, ``dispatch`` or ``weighting``.
    """

    def __init__(self, mode: Mode = "hierarchical", *, dispatch: Dispatch = "balanced",
                 weighting: Weighting = "share") -> None:
        if mode not in ("hierarchical", "global"):
            raise ConfigError(f"mode must be 'hierarchical' or 'global', got {mode!r}")
        if dispatch not in ("balanced", "even"):
            raise ConfigError(f"dispatch must be 'balanced' or 'even', got {dispatch!r}")
        if weighting not in ("share", "tokens"):
            raise ConfigError(f"weighting must be 'share' or 'tokens', got {weighting!r}")
        self._mode: Mode = mode
        self._dispatch: Dispatch = dispatch
        self._weighting: Weighting = weighting

    def place(self, load: torch.Tensor, topology: Topology) -> Placement:
        """See :meth:`PlacementPolicy.place`: ``load`` is ``[S, L, E]`` per-step counts."""
        return plan_peak(load, topology, self._mode, dispatch=self._dispatch, weighting=self._weighting)


if TYPE_CHECKING:
    from deepinfer_kit.eplb.protocols import PlacementPolicy

    _check: type[PlacementPolicy] = PeakPlacementPolicy
