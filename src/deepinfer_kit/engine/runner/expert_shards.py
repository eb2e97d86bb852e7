"""Expert parallelism on one rank: keep this rank's expert slots of every MoE layer and
route the rest over the expert-parallel group."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from deepinfer_kit.engine.runner.balance import ExpertBalancer, first_placement, moe_layers
from deepinfer_kit.eplb.config import EplbConfig
from deepinfer_kit.eplb.protocols import PlacementPolicy
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.protocols import CausalLM
from deepinfer_kit.moe.ep_dispatcher import ExpertParallelDispatcher
from deepinfer_kit.moe.protocols import ReplicaSelector

__all__ = ["shard_experts"]


def shard_experts(model: CausalLM, world: int, eplb: EplbConfig | None,
                  device: torch.device, group: dist.ProcessGroup | None = None, *,
                  policy: PlacementPolicy | None = None,
                  selectors: Callable[[int], ReplicaSelector] | None = None) -> ExpertBalancer | None:
    """Keep this rank's slots of every MoE layer and route through ``group``: one slot per
    expert (expert ``e`` on rank ``e // (E / world)``), or with ``eplb`` the
    ``E + num_redundant`` slots of :func:`first_placement`, and then the balancer over
    them (returned). ``group``: the expert-parallel process group (``None``: the world).
    ``policy``, ``selectors``: the balancer's injected parts (see :class:`ExpertBalancer`).

    Called once per rank by :func:`~deepinfer_kit.engine.runner.build.build_device`, after
    the warm-up's local forwards (from then on every forward is collective). Mutates the
    model's MoE layers (their dispatchers and expert weights).

    Raises:
        ConfigError: the model has no MoE layers, or its slots do not divide by ``world``.
    """
    layers = moe_layers(model)
    if not layers:
        raise ConfigError(f"expert_parallel={world} needs a model with MoE layers; this model has none")
    experts = layers[0].config.num_experts
    rows = (first_placement(eplb, layers).phy2log.tolist() if eplb is not None
            else [list(range(experts))] * len(layers))
    for layer, row in zip(layers, rows):
        if len(row) % world:
            raise ConfigError(f"expert_parallel={world} must divide the {len(row)} expert slots per layer")
        layer.use_expert_parallel(ExpertParallelDispatcher(layer.config.num_experts, row, group))
    if eplb is None:
        return None
    return ExpertBalancer(eplb, layers, device, policy=policy, selectors=selectors)
