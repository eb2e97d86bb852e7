"""Verify-length planners: fixed γ, a static survival threshold, and DSpark's
hardware-aware prefix scheduler (its candidate walk in :mod:`deepinfer_kit.spec.walk`). Pure host logic."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.spec.records import SpsCurve
from deepinfer_kit.spec.walk import Walk

if TYPE_CHECKING:
    from deepinfer_kit.spec.protocols import BudgetedPlanner, VerifyPlanner

__all__ = ["FixedPlanner", "ThresholdPlanner", "DSparkPlanner", "survival", "THRESHOLD_RULES"]


def survival(confidence: Sequence[float], limit: int) -> list[float]:
    """``a_j = prod_{i <= j} c_i`` for ``j < limit``: the estimated probability that drafts
    ``0..j`` are all accepted. Confidences are clamped to ``[0, 1]``."""
    out: list[float] = []
    a = 1.0
    for c in confidence[:limit]:
        a *= min(1.0, max(0.0, float(c)))
        out.append(a)
    return out


class FixedPlanner:
    """Verify every available draft, up to ``num_draft`` (``None``: all of them)."""

    def __init__(self, num_draft: int | None = None) -> None:
        if num_draft is not None and (isinstance(num_draft, bool) or num_draft < 0):
            raise ConfigError(f"num_draft must be >= 0, got {num_draft!r}")
        self.num_draft = num_draft

    def plan(self, confidence: Sequence[Sequence[float]], max_lengths: Sequence[int],
             other_tokens: int = 0) -> list[int]:
        """``min(num_draft, max_lengths[r])`` per request; see :meth:`VerifyPlanner.plan`."""
        cap = self.num_draft
        return [m if cap is None else min(cap, m) for m in max_lengths]


THRESHOLD_RULES = ("survival", "step")


class ThresholdPlanner:
    """Verify a request's drafts while they clear ``threshold``.

    ``rule="survival"`` (the default): while the cumulative survival ``a_{r,j} = prod_{i<=j}
    c_{r,i}`` — the estimated probability that draft ``j`` is accepted — stays at or above
    ``threshold``; every verified draft then has at least that chance of being kept, so the
    threshold bounds the waste per verified token. ``rule="step"``: while each draft's own
    confidence ``c_{r,j}`` (conditional on the drafts before it) stays at or above it — the
    early stop of DeepSpec's DSpark evaluation, which verifies a long chain of moderately
    confident drafts even when its tail is unlikely to survive (five drafts of 0.6 each:
    the fifth survives with 0.08).

    Either way the first draft that falls below is not verified, nor any after it; a
    threshold of 0 verifies every draft, one above 1 none. The decision on draft ``j``
    reads confidences ``c_{r,0..j}`` only, so it is non-anticipating whenever the drafter's
    ``c_{r,j}`` does not read draft ``j`` itself.

    Raises:
        ConfigError: ``threshold`` negative or not finite, or an unknown ``rule``.
    """

    def __init__(self, threshold: float = 0.5, rule: str = "survival") -> None:
        if not 0.0 <= float(threshold) < float("inf"):
            raise ConfigError(f"threshold must be a finite number >= 0, got {threshold!r}")
        if rule not in THRESHOLD_RULES:
            raise ConfigError(f"threshold rule must be one of {THRESHOLD_RULES}, got {rule!r}")
        self.threshold = float(threshold)
        self.rule = rule

    def plan(self, confidence: Sequence[Sequence[float]], max_lengths: Sequence[int],
             other_tokens: int = 0) -> list[int]:
        """See :meth:`VerifyPlanner.plan` (``other_tokens`` is ignored). O(sum max_lengths)."""
        return [self.length(conf, m) for conf, m in zip(confidence, max_lengths)]

    def length(self, confidence: Sequence[float], limit: int) -> int:
        """Drafts of one request verified: the number of leading drafts (at most ``limit``)
        that clear the threshold under the rule. Pure."""
        thr = self.threshold
        if self.rule == "step":
            n = 0
            for c in confidence[:limit]:
                if min(1.0, max(0.0, float(c))) < thr:
                    break
                n += 1
            return n
        n = 0
        for a in survival(confidence, limit):
            if a < thr:
                break
            n += 1
        return n


class DSparkPlanner:
    """DSpark's hardware-aware prefix scheduler: verify the drafts that maximise
    ``Θ = τ · SPS(B)`` (Algorithm 1 of the DSpark paper) on any non-decreasing step-time
    curve, staircases included.

    Each of the ``R`` requests verifies its base token (``B`` starts at ``R``, expected
    tokens ``τ`` at ``R``). Candidates ``(r, j)`` with a positive survival ``a_{r,j} =
    prod_{i <= j} c_{r,i}`` are ranked in decreasing order of survival (ties: earlier ``j``
    first, then lower ``r``, so a request's ``j``-th draft always follows its ``(j-1)``-th
    — survival never grows with ``j``); verifying the first ``k`` adds their survivals to
    ``τ`` and ``k`` to ``B``. For a fixed ``k`` the top-``k`` survivals maximise ``τ`` over
    prefix-closed selections, so the optimum over all selections is the best ``k`` of that
    one walk. A draft of zero survival is never verified.

    Two ways to pick ``k``, both exact (the decision to verify draft ``j`` of request ``r``
    never reads draft ``j``'s value, nor a confidence computed after it was drawn, given a
    drafter whose ``c_{r,j}`` does not read draft ``j``; docs/speculative.md):

    - :meth:`plan_budgeted` (what :class:`~deepinfer_kit.spec.planning.RoundPlanner` and so
      the engine call): walk *every* candidate of a budget confidence — each request's
      confidences from its previous round, as DeepInfer's ``MTPVarlen::schedule`` does —
      and keep the ``k`` of the largest ``Θ``; then verify the top ``k`` of this round's
      candidates. The budget reads nothing drawn this round, and the rank of ``(r, j)``
      reads only candidates sorted before it (this request's ``c_{r,0..j}`` and other
      requests' confidences). The global maximum of the walk, on any curve: a staircase
      (rounds padded to captured sizes) is handled as well as a roofline.
    - :meth:`plan`: stop at the first candidate of this round's walk that would not raise
      ``Θ``. Its admission of ``(r, j)`` reads only candidates sorted before it, so it
      needs no history; it is the global maximum only when ``Θ`` is unimodal along the walk
      (a convex, non-decreasing step time such as a roofline's flat-then-linear one) and
      stops at the first step of a staircase. Looking past the stop on this round's
      confidences would let later drafts' confidences decide earlier admissions (the
      paper's Appendix A counterexample).

    Prefill in the same round (``other_tokens = P``): the step really runs ``B + P``
    tokens, so each draft costs the marginal time at ``B + P`` on the curve; the prefill
    pays for its own time, ``1/SPS(R + P) − 1/SPS(R)``, which is left out of the round's
    rate — otherwise a round made slow by a long prefill would look cheap to add drafts
    to. So ``Θ = τ / (1/SPS(B + P) − 1/SPS(R + P) + 1/SPS(R))``, which is ``τ · SPS(B)``
    when ``P = 0``.

    Args:
        sps: the profiled steps-per-second curve ``SPS(B)`` (read through :attr:`sps` at
            each plan: an online correction replaces it, :class:`~deepinfer_kit.spec.sps_online.MeasuredSps`).
    """

    def __init__(self, sps: SpsCurve) -> None:
        self.sps = sps

    def plan(self, confidence: Sequence[Sequence[float]], max_lengths: Sequence[int],
             other_tokens: int = 0) -> list[int]:
        """The early stop on this round's confidences (class docstring); see
        :meth:`VerifyPlanner.plan`. O(C log C) for ``C = sum max_lengths``."""
        walk = Walk(confidence, max_lengths)
        return walk.lengths(walk.best(self.sps, other_tokens, early_stop=True))

    def plan_budgeted(self, confidence: Sequence[Sequence[float]], max_lengths: Sequence[int],
                      other_tokens: int, budget_confidence: Sequence[Sequence[float]]) -> list[int]:
        """Verify the top :meth:`best_total` of this round's candidates, the total chosen
        by walking ``budget_confidence`` (class docstring; see :meth:`BudgetedPlanner.plan_budgeted`).

        Args:
            confidence: ``[R][γ]`` this round's confidences (they rank the candidates).
            max_lengths: ``[R]`` drafts available per request.
            other_tokens: the round's prefill tokens.
            budget_confidence: ``[R][*]`` confidences that decide how many drafts the round
                verifies in all; only the first ``max_lengths[r]`` of each row are read.

        Returns:
            ``[R]`` lengths. Pure; O(C log C).
        """
        total = Walk(budget_confidence, max_lengths).best(self.sps, other_tokens)
        return Walk(confidence, max_lengths).lengths(total)

    def best_total(self, survivals: Sequence[float], num_requests: int, other_tokens: int = 0) -> int:
        """The number ``k`` of drafts to verify that maximises ``Θ`` when the ``k`` verified
        have the first ``k`` of ``survivals`` (positive, sorted in decreasing order): the
        whole walk, the first of equal maxima. Pure."""
        return Walk.ranked(survivals, num_requests).best(self.sps, other_tokens)


if TYPE_CHECKING:
    _fixed: type[VerifyPlanner] = FixedPlanner
    _threshold: type[VerifyPlanner] = ThresholdPlanner
    _dspark: type[BudgetedPlanner] = DSparkPlanner
