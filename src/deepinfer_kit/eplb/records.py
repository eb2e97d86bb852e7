"""Records of the eplb package: the cluster shape and an expert placement.

Shape symbols: ``L`` MoE layers, ``E`` logical experts, ``P`` physical expert slots per
layer, ``R`` most replicas of one expert.
"""

from __future__ import annotations

import attrs
import torch

from deepinfer_kit._validators import int_at_least

__all__ = ["Topology", "Placement"]


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
