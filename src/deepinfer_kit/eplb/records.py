"""Records of the eplb package: the cluster shape, an expert placement, and what a live
balancer reports (one rebalance; its state as a host sees it).

Shape symbols: ``L`` MoE layers, ``E`` logical experts, ``P`` physical expert slots per
layer, ``R`` most replicas of one expert.
"""

from __future__ import annotations

import attrs
import torch

from deepinfer_kit._validators import int_at_least

__all__ = ["Topology", "Placement", "Rebalance", "BalancerState"]


@attrs.frozen(slots=True)
class Topology:
    """Where physical experts can live.

    Attributes:
        num_physical_experts: ``P``, expert slots per layer over all GPUs.
        num_groups: expert groups (DeepSeek-V3 ``n_group``); 1 when routing is not grouped.
        num_nodes: server nodes.
        num_gpus: GPUs over all nodes; ``P`` must be a multiple of it.
    """

    num_physical_experts: int = attrs.field(validator=int_at_least(1))
    num_groups: int = attrs.field(default=1, validator=int_at_least(1))
    num_nodes: int = attrs.field(default=1, validator=int_at_least(1))
    num_gpus: int = attrs.field(default=1, validator=int_at_least(1))


@attrs.define(slots=True, eq=False)
class Placement:
    """Where every replica of every expert lives.

    Attributes:
        phy2log: ``[L, P]`` int64, the logical expert in each physical slot (slot ``s`` is on
            GPU ``s // (P / num_gpus)``).
        log2phy: ``[L, E, R]`` int64, the physical slots of each expert's replicas, padded
            with -1 beyond ``logcnt``.
        logcnt: ``[L, E]`` int64, replicas of each logical expert (``>= 1``).
    """

    phy2log: torch.Tensor
    log2phy: torch.Tensor
    logcnt: torch.Tensor


@attrs.frozen(slots=True)
class Rebalance:
    """What one rebalance did (kept in :attr:`~deepinfer_kit.engine.runner.balance.ExpertBalancer.history`).

    Attributes:
        after_step: rebalanced once this many rounds had committed (the rebalance clock,
            :attr:`~deepinfer_kit.engine.runner.balance.ExpertBalancer.num_steps`).
        window: ``[L, E]`` int64 counts (CPU) of the window the plan was made from,
            summed over its steps (the policy saw them per step).
        before, after: ``[L, G]`` float64 load of each GPU under the old and the new
            placement, both on ``window`` (what the heatmaps draw).
        balancedness_before, balancedness_after: mean over layers and the window's steps
            of each step's mean / max GPU load (an expert's count split evenly over its
            replicas), the judge of the keep rule; equal to the balancedness of
            ``before`` / ``after`` for a one-step window.
        phy2log: ``[L, P]`` int64, the new slot map.
        moved_slots: slots whose weights were copied; ``moved_bytes`` their size.
        plan_s, apply_s: time planning, and copying weights plus swapping tables.
    """

    after_step: int
    window: torch.Tensor
    before: torch.Tensor
    after: torch.Tensor
    balancedness_before: float
    balancedness_after: float
    phy2log: torch.Tensor
    moved_slots: int
    moved_bytes: int
    plan_s: float
    apply_s: float


@attrs.frozen(slots=True)
class BalancerState:
    """What a host needs of a balancer that lives in a worker process
    (:class:`~deepinfer_kit.engine.remote.balancer.RemoteBalancer`); picklable.

    Attributes:
        topology, num_experts, placement: as on :class:`~deepinfer_kit.engine.runner.balance.ExpertBalancer`.
    """

    topology: Topology
    num_experts: int
    placement: Placement
