"""Contract of the eplb package: the PlacementPolicy, fed a window of per-step counts."""

from __future__ import annotations

from typing import Protocol

import torch

from deepinfer_kit.eplb.records import Placement, Topology

__all__ = ["PlacementPolicy"]


class PlacementPolicy(Protocol):
    """Replicates and places experts so every GPU gets a similar load."""

    def place(self, load: torch.Tensor, topology: Topology) -> Placement:
        """Plan a placement from a window of observed load.

        Called by the engine's balancer every ``eplb.interval`` steps (the window's steps
        recorded so far, at most ``eplb.window``), by the simulator and by the evaluation
        helpers. A policy that plans from the window's total sums ``load`` over dim 0
        (:func:`~deepinfer_kit.eplb.steps.window_sum`); a one-step window then plans as
        the old ``[L, E]`` contract did, and a window whose steps are all alike must plan
        as the one step of their sum.

        Args:
            load: ``[S, L, E]`` tokens routed to each logical expert in each of the
                window's ``S >= 1`` steps, oldest first (CPU, any integer or floating
                dtype); not mutated.
            topology: the slots and GPUs to place on.

        Returns:
            A :class:`Placement` on the CPU. Every expert gets at least one replica; replica
            counts sum to ``P`` per layer.

        Raises:
            ConfigError: ``load`` not ``[S, L, E]`` with ``S, L, E >= 1``, a bool or
                complex dtype, a negative or non-finite count (the message names
                ``load`` and the value); ``P < E``, or ``P`` not divisible by the GPUs, or
                the groups not divisible by the nodes.
        """
        ...
