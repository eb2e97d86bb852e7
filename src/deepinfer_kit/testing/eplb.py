"""Conformance suite for PlacementPolicy."""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer_kit.eplb.protocols import PlacementPolicy
from deepinfer_kit.eplb.records import Topology
from deepinfer_kit.testing.suite import Suite, expect

__all__ = ["PlacementFactory", "PLACEMENT_POLICY_SUITE"]

PlacementFactory = Callable[[], PlacementPolicy]
"""``factory()`` -> a placement policy."""

PLACEMENT_POLICY_SUITE: Suite[PlacementFactory] = Suite("PlacementPolicy", "factory() -> PlacementPolicy")


@PLACEMENT_POLICY_SUITE.check
def check_every_expert_placed_and_slots_filled(factory: PlacementFactory) -> None:
    load = torch.tensor([[90, 10, 10, 10, 5, 5, 5, 5], [1, 1, 1, 1, 1, 1, 1, 1]])
    placement = factory().place(load, Topology(num_physical_experts=12, num_gpus=4))
    expect(tuple(placement.phy2log.shape) == (2, 12), f"phy2log shape {tuple(placement.phy2log.shape)}")
    expect(bool((placement.logcnt >= 1).all()), "every logical expert needs a replica")
    expect(bool((placement.logcnt.sum(dim=1) == 12).all()), "replica counts must sum to P")
