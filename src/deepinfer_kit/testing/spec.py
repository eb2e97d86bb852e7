"""Conformance suites for VerifyPlanner and DraftVerifier."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deepinfer_kit.spec.protocols import DraftVerifier, VerifyPlanner
from deepinfer_kit.spec.verify.rows import verify_padded
from deepinfer_kit.testing.suite import Suite, expect

__all__ = ["PlannerFactory", "VerifierFactory", "VERIFY_PLANNER_SUITE", "DRAFT_VERIFIER_SUITE"]

PlannerFactory = Callable[[], VerifyPlanner]
"""``factory()`` -> a verify planner."""

VerifierFactory = Callable[[], DraftVerifier]
"""``factory()`` -> a draft verifier."""

VERIFY_PLANNER_SUITE: Suite[PlannerFactory] = Suite("VerifyPlanner", "factory() -> VerifyPlanner")
DRAFT_VERIFIER_SUITE: Suite[VerifierFactory] = Suite("DraftVerifier", "factory() -> DraftVerifier")


@VERIFY_PLANNER_SUITE.check
def check_lengths_within_bounds(factory: PlannerFactory) -> None:
    confidence = [[0.9, 0.8, 0.5, 0.1], [0.2, 0.1, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
    max_lengths = [4, 2, 0]
    lengths = factory().plan(confidence, max_lengths)
    expect(len(lengths) == 3, f"one length per request expected, got {lengths}")
    expect(
        all(0 <= n <= m for n, m in zip(lengths, max_lengths)),
        f"lengths must lie in [0, max_lengths]: got {lengths} for {max_lengths}",
    )


@VERIFY_PLANNER_SUITE.check
def check_empty_and_zero_inputs(factory: PlannerFactory) -> None:
    planner = factory()
    expect(planner.plan([], []) == [], "no requests must plan no lengths")
    lengths = planner.plan([[0.0, 0.0], [1.0]], [2, 1])
    expect(len(lengths) == 2 and lengths[0] in (0, 1, 2) and lengths[1] in (0, 1),
           f"lengths out of range for zero confidence: {lengths}")


def _verify_inputs(num_req: int, width: int, vocab: int, seed: int) -> tuple[Any, ...]:
    import torch

    from deepinfer_kit.sample.params import SamplingParams
    from deepinfer_kit.sample.records import SamplingBatch
    from deepinfer_kit.spec.records import DraftProposal

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_req, width + 1, vocab, generator=g)
    drafts = torch.randint(0, vocab, (num_req, width), generator=g)
    params = [SamplingParams(temperature=0.0) if r % 2 else SamplingParams(seed=r)
              for r in range(num_req)]
    batch = SamplingBatch(params, [None if r % 2 else r for r in range(num_req)],
                          [0] * num_req, [[1]] * num_req, [[] for _ in range(num_req)],
                          [None] * num_req)
    return DraftProposal(drafts, [width] * num_req), logits, batch


@DRAFT_VERIFIER_SUITE.check
def check_result_shapes_and_ranges(factory: VerifierFactory) -> None:
    vocab = 9
    proposal, logits, batch = _verify_inputs(5, 3, vocab, 0)
    lengths = [3, 0, 2, 1, 3]
    res = verify_padded(factory(), proposal, lengths, logits, batch)
    drafts = proposal.token_ids.tolist()
    expect(len(res.token_ids) == 5 and len(res.num_accepted) == 5, "one result per request")
    for r, (toks, a) in enumerate(zip(res.token_ids, res.num_accepted)):
        expect(0 <= a <= lengths[r], f"request {r}: {a} accepted of {lengths[r]}")
        expect(len(toks) == a + 1, f"request {r}: {len(toks)} tokens for {a} accepted")
        expect(toks[:a] == drafts[r][:a], f"request {r}: accepted tokens must be the drafts")
        expect(all(0 <= t < vocab for t in toks), f"request {r}: token outside [0, {vocab})")


@DRAFT_VERIFIER_SUITE.check
def check_greedy_rows_follow_the_argmax(factory: VerifierFactory) -> None:
    proposal, logits, batch = _verify_inputs(4, 2, 7, 1)
    greedy = logits.argmax(dim=-1).tolist()
    proposal.token_ids[1, 0] = greedy[1][0]  # accept the first draft of request 1
    res = verify_padded(factory(), proposal, [2, 2, 2, 2], logits, batch)
    for r in (1, 3):
        a = res.num_accepted[r]
        expect(res.token_ids[r][a] == greedy[r][a],
               f"greedy request {r}: token after {a} accepted must be the argmax")
        expect(all(proposal.token_ids[r, j] == greedy[r][j] for j in range(a)),
               f"greedy request {r}: accepted a draft that is not the argmax")
    expect(res.num_accepted[1] >= 1, "a draft equal to the argmax must be accepted")
