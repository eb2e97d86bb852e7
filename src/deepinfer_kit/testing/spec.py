"""Conformance suites for VerifyPlanner and DraftVerifier."""

from __future__ import annotations

from collections.abc import Callable

from deepinfer_kit.spec.protocols import DraftVerifier, VerifyPlanner
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
