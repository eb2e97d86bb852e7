"""RoundPlanner: a verify planner run round after round — it keeps each request's
confidences from its previous round, the budget a
:class:`~deepinfer_kit.spec.protocols.BudgetedPlanner` sizes the round with (and what a
lagged planner sees instead of this round's), cut to the part that reads nothing this
round draws again."""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer_kit.spec.protocols import BudgetedPlanner, VerifyPlanner

__all__ = ["RoundPlanner"]


class RoundPlanner:
    """Plans the verify lengths of successive rounds with ``planner``.

    What the planner sees of a request ``r`` drafted this round with confidences
    ``c_{r,0..γ-1}``, its first draft at output position ``q``:

    - ``confidence``: this round's row (``lagged``: the previous round's, see below; zeros
      the first time: nothing drawn this round is read at all).
    - ``budget_confidence`` (a :class:`BudgetedPlanner` only): the previous round's row,
      see below; the first time, ``c_{r,0}`` repeated (the confidence of the first draft is
      computed before any draft of this round is drawn).

    **The previous round's row is cut** to what reads nothing this round draws again. That
    round drafted from output position ``q'``; its ``c'_j`` read its drafts ``0..j-1``,
    drawn at positions ``q'..q'+j-1``. A seeded request draws each position's draft from
    a stream keyed by ``(seed, position)``, so this round's draft at position ``q`` reuses
    the uniform of the previous round's draft at ``q``: a ``c'_j`` with ``q' + j - 1 >= q``
    reads a value correlated with this round's drafts, and a total decided from it would
    let them decide whether they are verified. So ``c'_0..c'_{q-q'}`` are kept and the
    last kept value stands in for the rest. A request that sat a round out (prefilling,
    preempted), or whose position did not advance, starts afresh.

    Args:
        planner: the verify planner.
        lagged: see above (:class:`~deepinfer_kit.spec.speculation.Speculation`).
    """

    def __init__(self, planner: VerifyPlanner, *, lagged: bool = False) -> None:
        self.planner = planner
        self.lagged = lagged
        # resolved once: a runtime Protocol check costs tens of microseconds
        self._budgeted = planner if isinstance(planner, BudgetedPlanner) else None
        self._previous: dict[str, tuple[int, list[float]]] = {}  # id -> (position, row)

    def plan(self, request_ids: Sequence[str], positions: Sequence[int],
             confidence: Sequence[Sequence[float]], max_lengths: Sequence[int],
             other_tokens: int = 0) -> list[int]:
        """The lengths of this round's ``R`` requests: ``request_ids``, the output
        position of each one's first draft (``positions``: its outputs so far), their
        ``[R][γ]`` ``confidence`` and ``max_lengths``, the round's ``other_tokens``. Called
        once per round; remembers this round's rows for the next one (forgetting requests
        absent from it). O(planner)."""
        rows = [list(map(float, row)) for row in confidence]
        kept = [self._kept(rid, q, len(row)) for rid, q, row in zip(request_ids, positions, rows)]
        self._previous = {rid: (q, row) for rid, q, row in zip(request_ids, positions, rows)}
        seen: Sequence[Sequence[float]] = rows
        if self.lagged:
            seen = [k if k is not None else [0.0] * len(row) for k, row in zip(kept, rows)]
        if self._budgeted is None:
            return self.planner.plan(seen, max_lengths, other_tokens)
        budget = [k if k is not None else [0.0] * len(row) if self.lagged else [row[0]] * len(row) if row else []
                  for k, row in zip(kept, rows)]
        return self._budgeted.plan_budgeted(seen, max_lengths, other_tokens, budget)

    def _kept(self, request_id: str, position: int, width: int) -> list[float] | None:
        """The previous round's row of ``request_id`` cut at what this round draws again
        (class docstring), ``width`` long; ``None`` without one."""
        prev = self._previous.get(request_id)
        if prev is None or position <= prev[0] or not prev[1]:
            return None
        row = prev[1][: position - prev[0] + 1]
        return (row + [row[-1]] * width)[:width]

    def forget(self) -> None:
        """Drop every request's history (the engine was reset)."""
        self._previous = {}
