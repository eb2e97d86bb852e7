"""Speculative sampling is exact for every drafter x planner: the distribution suite over the
library's drafting step, planners and verifier, and the bugs it must catch (a confidence that
reads the drawn token; a bonus token drawn from the residual)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sample.vectorized import VectorizedSampler
from deepinfer_kit.spec.verify import ref_ops
from deepinfer_kit.spec.drafters.ngram import NgramDrafter
from deepinfer_kit.spec.planners import DSparkPlanner, FixedPlanner, ThresholdPlanner
from deepinfer_kit.spec.protocols import VerifyPlanner
from deepinfer_kit.spec.records import DraftProposal, SpsCurve
from deepinfer_kit.spec.verify.rejection import RejectionVerifier
from deepinfer_kit.testing.spec_distribution import (
    SPECULATIVE_DISTRIBUTION_SUITE, ToyLM, ToyModelDrafter, check_speculative_distribution,
    speculative_distribution, toy_model_drafter,
)
from deepinfer_kit.testing.spec_stats import chi_square_homogeneity, tv_distance
from deepinfer_kit.testing.suite import Check, ConformanceError

# the suite's rows are 3000 sequences of 1 + γ verified tokens: a knee at 3000 + 1500
# tokens makes the DSpark planner cut inside the run
KNEE = SpsCurve((1, 3000, 4500, 9000), (100.0, 100.0, 95.0, 30.0))

# a staircase with a step at every scale the suite runs: one sequence per round (1-3
# tokens) and the whole sample (3000-9000 tokens); the budgeted whole walk decides there
STAIRS = SpsCurve.ladder([1, 3, 3000, 4500, 9000], [1.0, 1.15, 1.3, 1.5, 3.0])

PLANNERS: dict[str, Callable[[], VerifyPlanner]] = {
    "fixed": FixedPlanner,
    "survival-0.1": lambda: ThresholdPlanner(0.1),
    "survival-0.3": lambda: ThresholdPlanner(0.3),
    "step-0.4": lambda: ThresholdPlanner(0.4, rule="step"),
    "dspark": lambda: DSparkPlanner(KNEE),
    "dspark-stairs": lambda: DSparkPlanner(STAIRS),
}


def _verifier() -> RejectionVerifier:
    return RejectionVerifier(VectorizedSampler("ref"))


@pytest.mark.parametrize("planner", sorted(PLANNERS))
@pytest.mark.parametrize("check", SPECULATIVE_DISTRIBUTION_SUITE.checks,
                         ids=SPECULATIVE_DISTRIBUTION_SUITE.ids)
def test_model_drafter_with_every_planner(planner: str, check: Check[Any]) -> None:
    check(lambda world: (toy_model_drafter(world), PLANNERS[planner](), _verifier()))


@pytest.mark.parametrize("stop", [0.2, 0.5])
def test_model_drafter_that_stops_where_the_threshold_planner_does(stop: float) -> None:
    params = SamplingParams(temperature=0.8, top_k=8, top_p=0.9)
    report = check_speculative_distribution(
        lambda w: (toy_model_drafter(w, stop_below=stop), ThresholdPlanner(stop), _verifier()),
        params, num_draft=3, positions=4)
    assert 0 < report.num_verified <= report.num_drafted


@pytest.mark.parametrize("planner", ["fixed", "survival-0.3"])
def test_ngram_drafter(planner: str) -> None:
    def factory(world: ToyLM) -> Any:
        return NgramDrafter(1, 2), PLANNERS[planner](), _verifier()

    params = SamplingParams(temperature=1.0, top_k=4)  # few tokens: the lookups often hit
    report = check_speculative_distribution(factory, params, prompt=(1, 2, 1, 2, 1), positions=4)
    assert report.num_verified > 0


class _AnticipatingDrafter(ToyModelDrafter):
    """The bug: each draft's confidence is the draft model's probability of the token just
    drawn, so the planner's cut reads the drafted values."""

    def propose(self, requests: Any, num_draft: int) -> DraftProposal:
        proposal = super().propose(requests, num_draft)
        ids = proposal.token_ids.tolist()
        conf = torch.zeros(len(requests), num_draft)
        for r, req in enumerate(requests):
            for j in range(proposal.num_drafted[r]):
                logits = self.model.logits([[*req.all_token_ids, *ids[r][:j]]])[0]
                conf[r, j] = torch.softmax(logits, -1)[ids[r][j]]
        proposal.confidence = conf
        return proposal


def test_a_confidence_that_reads_the_drawn_token_fails_the_suite() -> None:
    def factory(world: ToyLM) -> Any:
        draft = world.perturbed(0.8, 1)
        return _AnticipatingDrafter(draft, generator=torch.Generator().manual_seed(1)), \
            ThresholdPlanner(0.3), _verifier()

    with pytest.raises(ConformanceError, match="differ"):
        check_speculative_distribution(factory, SamplingParams(temperature=0.8, top_k=8, top_p=0.9))


class _PeekingBudget(DSparkPlanner):
    """The bug: the round's total is read from this round's confidences (the whole walk
    on them), so draft ``j + 1``'s confidence — computed from draft ``j`` — decides
    whether draft ``j`` is verified."""

    def plan_budgeted(self, confidence, max_lengths, other_tokens, budget_confidence):  # type: ignore[no-untyped-def]
        return super().plan_budgeted(confidence, max_lengths, other_tokens, confidence)


def test_a_budget_read_from_this_rounds_confidences_fails_the_suite() -> None:
    """One sequence per round, γ = 2 and a two-step staircase ``t(1) = 1, t(3) = T``:
    the whole walk verifies draft 0 when ``c_0 (1 + c_1) > T - 1``, and ``c_1`` is
    computed from draft 0. ``T`` puts the cut at the median ``c_1`` of the first draft."""
    world = ToyLM(16, seed=6)  # the world of the suite's one-sequence check
    draft = toy_model_drafter(world).model
    first = torch.softmax(draft.logits([[2, 3]]), -1)[0]
    c0 = float((first * first).sum())
    second = [torch.softmax(draft.logits([[3, x]]), -1)[0] for x in range(world.vocab)]
    c1 = sorted((float((s * s).sum()), float(first[x])) for x, s in enumerate(second))
    mass, median = 0.0, c1[-1][0]
    for c, w in c1:
        mass += w
        if mass >= 0.5:
            median = c
            break
    curve = SpsCurve.ladder([1, 3], [1.0, 1.0 + c0 * (1.0 + median)])
    check = SPECULATIVE_DISTRIBUTION_SUITE.checks[SPECULATIVE_DISTRIBUTION_SUITE.ids.index(
        "sampled_one_sequence_per_round")]
    check(lambda w: (toy_model_drafter(w), DSparkPlanner(curve), _verifier()))  # the honest budget
    with pytest.raises(ConformanceError, match="differ"):
        check(lambda w: (toy_model_drafter(w), _PeekingBudget(curve), _verifier()))


_TRUE_REJECTION = ref_ops.rejection_sample


def _bonus_from_residual(target, draft_probs, draft_ids, lengths, u_accept, u_draw):  # type: ignore[no-untyped-def]
    """The bug: when every verified draft is accepted, the bonus token is drawn from the
    residual ``max(0, p - q)`` at the next row (as after a rejection) instead of from ``p``."""
    num_acc, token = _TRUE_REJECTION(target, draft_probs, draft_ids, lengths, u_accept, u_draw)
    width = draft_ids.shape[1]
    for r in range(draft_ids.shape[0]):
        a, n = int(num_acc[r]), int(lengths[r])
        if a == n < width:
            residual = (target[r, a] - draft_probs[r, a]).clamp(min=0)
            if float(residual.sum()) > 0:
                token[r] = ref_ops.inverse_cdf(residual[None], u_draw[r, a:a + 1])[0]
    return num_acc, token


def test_a_bonus_token_drawn_from_the_residual_fails_the_suite(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ref_ops, "rejection_sample", _bonus_from_residual)
    with pytest.raises(ConformanceError, match="differ"):
        check_speculative_distribution(
            lambda w: (toy_model_drafter(w), ThresholdPlanner(0.3), _verifier()),
            SamplingParams(temperature=0.8, top_k=8, top_p=0.9))


def test_the_suite_sees_no_difference_between_two_plain_samplers() -> None:
    """The noise floor: a 'drafter' that never drafts is plain sampling with other seeds."""
    def factory(world: ToyLM) -> Any:
        return NgramDrafter(5, 5), FixedPlanner(), _verifier()

    report = speculative_distribution(factory, SamplingParams(temperature=0.8, top_k=8, top_p=0.9),
                                      prompt=(1, 2, 3))
    assert report.num_verified == 0
    assert all(c.p_value > 0.01 and c.tv < 0.05 for c in report.comparisons)


def test_statistics() -> None:
    assert tv_distance([1, 1, 2, 2], [1, 2, 2, 2]) == pytest.approx(0.25)
    same = [i % 5 for i in range(1000)]
    assert chi_square_homogeneity(same, same)[2] == pytest.approx(1.0)
    skewed = [0] * 600 + [1] * 400
    stat, dof, p = chi_square_homogeneity([0] * 500 + [1] * 500, skewed)
    assert dof == 1 and stat == pytest.approx(2 * 2500 / 550 + 2 * 2500 / 450) and p < 1e-4
    assert chi_square_homogeneity([0] * 10, [0] * 10) == (0.0, 0, 1.0)
