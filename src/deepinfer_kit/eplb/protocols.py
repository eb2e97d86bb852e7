"""Contract of the eplb package: the PlacementPolicy."""

from __future__ import annotations

from typing import Protocol

import torch

from deepinfer_kit.eplb.records import Placement, Topology

__all__ = ["PlacementPolicy"]


class PlacementPolicy(Protocol):
    """Replicates and places experts so every GPU gets a similar load."""

    def place(self, load: torch.Tensor, topology: Topology) -> Placement:
        """Plan a placement from a window of observed load.

        Args:
            load: ``[L, E]`` tokens routed to each logical expert (CPU, any numeric dtype).
            topology: the slots and GPUs to place on.

        Returns:
            A :class:`Placement` on the CPU. Every expert gets at least one replica; replica
            counts sum to ``P`` per layer.

        Raises:
            ConfigError: ``P < E``, or ``P`` not divisible by the GPUs, or the groups not
                divisible by the nodes.
        """
        ...
