"""Speculation: the engine's drafting phase — propose drafts for the decoding sequences,
plan their verification lengths, and hand them to the scheduler before it plans a round."""

from __future__ import annotations

from typing import Any, cast

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sched.protocols import DraftTarget
from deepinfer_kit.spec.protocols import Drafter, VerifyPlanner

__all__ = ["Speculation"]


class Speculation:
    """Drafts ``num_draft`` (γ) tokens per decoding sequence and plans how many to verify.

    Every running sequence whose KV covers all its tokens but the last (it decodes next)
    is drafted for, fork children included; a sequence still prefilling (an ``n > 1``
    request before its fork among them) is not. The verification itself is the runner's
    (a :class:`~deepinfer_kit.spec.protocols.DraftVerifier`), and rollback the scheduler's.

    Args:
        drafter: proposes drafts and per-position confidences.
        planner: picks each sequence's verification length from the confidences
            (confidence 1 when the drafter gives none).
        num_draft: γ, drafts proposed per sequence and round.

    Attributes:
        num_drafted, num_planned: totals over the engine's life (drafts proposed, drafts
            sent to verification).
    """

    def __init__(self, drafter: Drafter, planner: VerifyPlanner, num_draft: int) -> None:
        self.drafter = drafter
        self.planner = planner
        self.num_draft = num_draft
        self.num_drafted = 0
        self.num_planned = 0

    def target(self, scheduler: Any, depth: int) -> DraftTarget:
        """The scheduler as a :class:`DraftTarget`; called once when the engine is built.

        Raises:
            ConfigError: the scheduler takes no drafts (no ``set_spec_tokens`` /
                ``running``), or the executor overlaps rounds (``depth != 0``).
        """
        if depth != 0:
            raise ConfigError(
                f"speculative decoding needs a synchronous executor (overlap=False); got an "
                f"executor of depth {depth}: set overlap=False or speculative=None"
            )
        if not callable(getattr(scheduler, "set_spec_tokens", None)) or not hasattr(scheduler, "running"):
            raise ConfigError(
                f"speculative decoding needs a scheduler with set_spec_tokens() and running; "
                f"{type(scheduler).__name__} has not"
            )
        return cast(DraftTarget, scheduler)

    def draft(self, scheduler: DraftTarget) -> None:
        """Propose, plan and hand the drafts to ``scheduler`` for its next ``schedule()``.

        Called by the engine before each round is planned, under its lock. Reads the live
        running sequences; mutates the scheduler's pending drafts (every drafted sequence
        gets a list, possibly empty, replacing any stale one). O(drafter + planner).
        """
        live = [
            r for r in scheduler.running
            if r.block_table and r.num_computed_tokens == len(r.all_token_ids) - 1
        ]
        if not live:
            return
        gamma = self.num_draft
        proposal = self.drafter.propose(live, gamma)
        ids: list[list[int]] = proposal.token_ids.tolist()
        conf: list[list[float]] = (
            proposal.confidence.tolist() if proposal.confidence is not None
            else [[1.0] * gamma for _ in live]
        )
        lengths = self.planner.plan(conf, proposal.num_drafted)
        for req, row, n, made in zip(live, ids, lengths, proposal.num_drafted):
            self.num_drafted += made
            self.num_planned += n
            scheduler.set_spec_tokens(req.request_id, row[:n])
