"""Verify-length planners: fixed γ, a static survival threshold, and DSpark's
hardware-aware prefix scheduler. Pure host logic over Python floats."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.spec.records import SpsCurve

if TYPE_CHECKING:
    from deepinfer_kit.spec.protocols import VerifyPlanner

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
    ``Θ = τ · SPS(B)`` (Algorithm 1 of the DSpark paper).

    Each of the ``R`` requests verifies its base token (``B`` starts at ``R``, expected
    tokens ``τ`` at ``R``). Candidates ``(r, j)`` with a positive survival ``a_{r,j} =
    prod_{i <= j} c_{r,i}`` are admitted in decreasing order of survival (ties: earlier
    ``j`` first, so a request's ``j``-th draft always follows its ``(j-1)``-th — survival
    never grows with ``j``); each admission adds ``a_{r,j}`` to ``τ`` and 1 to ``B``. A
    draft of zero survival is never verified. Admission stops at the first candidate that
    would not raise ``Θ``. For a fixed ``B`` the top-``B`` survivals maximise ``τ``, so
    when ``Θ`` is unimodal along that path — a step time that is convex and non-decreasing
    in ``B``, such as a roofline's flat-then-linear one — the early stop finds the global
    maximum over prefix-closed selections.

    The early stop is also what keeps the planner exact: the admission of ``(r, j)`` reads
    only the candidates sorted before it, whose survivals involve request ``r``'s
    confidences ``c_{r,0..j}`` alone — never one computed after draft ``j`` was drawn. A
    search that looked past the stop would let later drafts' confidences decide earlier
    admissions (the paper's Appendix A counterexample).

    Prefill in the same round (``other_tokens = P``): the step really runs ``B + P``
    tokens, so each draft costs the marginal time at ``B + P`` on the curve; the prefill
    pays for its own time, ``1/SPS(R + P) − 1/SPS(R)``, which is left out of the round's
    rate — otherwise a round made slow by a long prefill would look cheap to add drafts
    to. So ``Θ = τ / (1/SPS(B + P) − 1/SPS(R + P) + 1/SPS(R))``, which is ``τ · SPS(B)``
    when ``P = 0``.

    Args:
        sps: the profiled steps-per-second curve ``SPS(B)``.
    """

    def __init__(self, sps: SpsCurve) -> None:
        self.sps = sps

    def plan(self, confidence: Sequence[Sequence[float]], max_lengths: Sequence[int],
             other_tokens: int = 0) -> list[int]:
        """See :meth:`VerifyPlanner.plan` and the class docstring for ``other_tokens``.
        O(C log C) for ``C = sum max_lengths``."""
        num_req = len(max_lengths)
        candidates = [
            (-a, j, r)
            for r, (conf, m) in enumerate(zip(confidence, max_lengths))
            for j, a in enumerate(survival(conf, m))
            if a > 0.0
        ]
        candidates.sort()
        lengths = [0] * num_req
        tau = float(num_req)
        sps = self.sps
        other = max(0, other_tokens)
        tokens = num_req + other
        # seconds of the step that are the prefill's, not the verified chunks'
        prefill_s = 1.0 / sps(tokens) - 1.0 / sps(num_req) if other else 0.0
        theta = tau / (1.0 / sps(tokens) - prefill_s)
        for neg_a, j, r in candidates:
            if j != lengths[r]:
                continue  # unreachable: survival is non-increasing in j
            nxt = (tau - neg_a) / (1.0 / sps(tokens + 1) - prefill_s)
            if not nxt > theta:
                break
            tau, tokens, theta = tau - neg_a, tokens + 1, nxt
            lengths[r] = j + 1
        return lengths


if TYPE_CHECKING:
    _fixed: type[VerifyPlanner] = FixedPlanner
    _threshold: type[VerifyPlanner] = ThresholdPlanner
    _dspark: type[VerifyPlanner] = DSparkPlanner
