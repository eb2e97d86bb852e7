"""RoundPlanner: a verify planner run round after round — it keeps each request's
confidences from its previous round, the budget a
:class:`~deepinfer_kit.spec.protocols.BudgetedPlanner` sizes the round with (and what a
lagged planner sees instead of this round's)."""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer_kit.spec.protocols import BudgetedPlanner, VerifyPlanner

__all__ = ["RoundPlanner"]


class RoundPlanner:
    """Plans the verify lengths of successive rounds with ``planner``.

    What the planner sees of a request ``r`` drafted this round with confidences
    ``c_{r,0..γ-1}``:

    - ``confidence``: this round's row (``lagged``: its previous round's row, zeros the
      first time: nothing drawn this round is read at all).
    - ``budget_confidence`` (a :class:`BudgetedPlanner` only): its previous round's row;
      the first time, ``c_{r,0}`` repeated (the confidence of the first draft is computed
      before any draft of this round is drawn). A request that sat a round out (prefilling,
      preempted) starts afresh.

    Args:
        planner: the verify planner.
        lagged: see above (:class:`~deepinfer_kit.spec.speculation.Speculation`).
    """

    def __init__(self, planner: VerifyPlanner, *, lagged: bool = False) -> None:
        self.planner = planner
        self.lagged = lagged
        # resolved once: a runtime Protocol check costs tens of microseconds
        self._budgeted = planner if isinstance(planner, BudgetedPlanner) else None
        self._previous: dict[str, list[float]] = {}

    def plan(self, request_ids: Sequence[str], confidence: Sequence[Sequence[float]],
             max_lengths: Sequence[int], other_tokens: int = 0) -> list[int]:
        """The lengths of this round's ``R`` requests (``request_ids``, their ``[R][γ]``
        ``confidence`` and ``max_lengths``, the round's ``other_tokens``). Called once per
        round; remembers this round's rows for the next one (forgetting requests absent
        from it). O(planner)."""
        previous = self._previous
        rows = [list(map(float, row)) for row in confidence]
        seen: Sequence[Sequence[float]] = rows
        if self.lagged:
            seen = [previous.get(rid) or [0.0] * len(row) for rid, row in zip(request_ids, rows)]
        self._previous = dict(zip(request_ids, rows))
        if self._budgeted is None:
            return self.planner.plan(seen, max_lengths, other_tokens)
        budget = [previous.get(rid) or ([0.0] * len(row) if self.lagged else [row[0]] * len(row) if row else [])
                  for rid, row in zip(request_ids, rows)]
        return self._budgeted.plan_budgeted(seen, max_lengths, other_tokens, budget)

    def forget(self) -> None:
        """Drop every request's history (the engine was reset)."""
        self._previous = {}
