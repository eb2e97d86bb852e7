"""The sim package's Protocols: what prices a step."""

from __future__ import annotations

from typing import Protocol

from deepinfer_kit.sim.records import StepShape

__all__ = ["CostModel"]


class CostModel(Protocol):
    """Prices a round: the seconds a model would take to run it on some hardware.

    Called once per simulated round by :class:`~deepinfer_kit.sim.runner.SimRunner`
    (its ``prepare``); must be pure and cheap (O(1)): it runs 100,000s of times.
    """

    def step_time(self, shape: StepShape) -> float:
        """Seconds to execute a round of ``shape`` (>= 0). Mutates nothing; raises
        nothing for a valid shape."""
        ...
