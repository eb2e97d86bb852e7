"""The sim package's Protocols: what prices a step."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from deepinfer_kit.sim.records import StepShape

__all__ = ["CostModel", "DecodeRoundCost"]


class CostModel(Protocol):
    """Prices a round: the seconds a model would take to run it on some hardware.

    Called once per simulated round by :class:`~deepinfer_kit.sim.runner.SimRunner`
    (its ``prepare``); must be pure and cheap (O(1)): it runs 100,000s of times.
    """

    def step_time(self, shape: StepShape) -> float:
        """Seconds to execute a round of ``shape`` (>= 0). Mutates nothing; raises
        nothing for a valid shape."""
        ...


@runtime_checkable
class DecodeRoundCost(Protocol):
    """A :class:`CostModel` that also prices a stretch of consecutive plain-decode rounds
    in one call (the simulator's stretches, ``docs/simulation.md``); optional — without
    it the runner calls ``step_time`` per round."""

    def decode_round_times(self, num_seqs: int, context: int, start: float, until: float,
                           max_rounds: int) -> list[float]:
        """``step_time(StepShape(0, n, c, n, c, n))`` for ``n = num_seqs`` and
        ``c = context, context + n, context + 2n, ...``, each the very float ``step_time``
        returns; the first round starts at ``start`` (seconds) and each next one when the
        previous ends (summed in order); stops at ``max_rounds`` or before a round that
        would start at or after ``until`` (the first is always priced). Pure;
        O(rounds)."""
        ...
