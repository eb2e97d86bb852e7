"""Speculation: the engine's drafting phase — propose drafts for the decoding sequences,
plan their verification lengths, and hand them to the scheduler before it plans a round."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sched.protocols import DraftTarget
from deepinfer_kit.spec.protocols import Drafter, DraftSequence, StatefulDrafter, VerifyPlanner

__all__ = ["Speculation"]


class Speculation:
    """Drafts ``num_draft`` (γ) tokens per decoding sequence and plans how many to verify.

    Every running sequence whose KV covers all its tokens but the last (it decodes next)
    is drafted for, fork children included; a sequence still prefilling (an ``n > 1``
    request before its fork among them) is not. The verification itself is the runner's
    (a :class:`~deepinfer_kit.spec.protocols.DraftVerifier`), and rollback the scheduler's
    (target KV) and the drafter's (its own KV, through :meth:`sync`).

    When the drafter returns ``draft_probs`` (a draft model), each drafted sequence's
    probabilities are kept until the next drafting phase, for the runner to hand to the
    verifier with the drafts the scheduler kept (:meth:`draft_probs`).

    Args:
        drafter: proposes drafts and per-position confidences.
        planner: picks each sequence's verification length from the confidences
            (confidence 1 when the drafter gives none).
        num_draft: γ, drafts proposed per sequence and round.
        lagged: the asynchronous variant: the planner sees each sequence's confidences
            from its *previous* drafting round (what an overlapped engine knows when it
            plans round ``k + 1`` while round ``k`` runs), and a sequence drafted for the
            first time gets zero confidences (no planner but the fixed one verifies a draft
            of zero survival). The lengths are still capped by this round's drafts. The
            lengths then read nothing drawn this round, so they are non-anticipating.

    Attributes:
        num_drafted, num_planned: totals over the engine's life (drafts proposed, drafts
            sent to verification).
    """

    def __init__(self, drafter: Drafter, planner: VerifyPlanner, num_draft: int, *,
                 lagged: bool = False) -> None:
        self.drafter = drafter
        # resolved once: a runtime Protocol check costs ~50 us, and sync runs twice a round
        self._stateful = drafter if isinstance(drafter, StatefulDrafter) else None
        self.planner = planner
        self.num_draft = num_draft
        self.lagged = lagged
        self._previous: dict[str, list[float]] = {}  # lagged: last round's confidences
        self.num_drafted = 0
        self.num_planned = 0
        self._probs: dict[str, tuple[list[int], torch.Tensor]] = {}

    def target(self, scheduler: Any, depth: int) -> DraftTarget:
        """The scheduler as a :class:`DraftTarget`; called once when the engine is built.

        Raises:
            ConfigError: the scheduler takes no drafts (no ``set_spec_tokens`` /
                ``pending_prefill_tokens`` / ``running``), or the executor overlaps rounds
                (``depth != 0``: the host's drafts would need the tokens still in flight; under
                overlap the runner drafts, see :mod:`deepinfer_kit.engine.runner.drafting`).
        """
        if depth != 0:
            raise ConfigError(
                f"host-side speculation needs a synchronous executor (overlap=False); got an "
                f"executor of depth {depth}: set overlap=False, or draft on the runner's side "
                f"(ModelRunner.drafting with BatchScheduler.reserve_drafts, what build_engine "
                f"does under overlap)"
            )
        if (not callable(getattr(scheduler, "set_spec_tokens", None))
                or not callable(getattr(scheduler, "pending_prefill_tokens", None))
                or not hasattr(scheduler, "running")):
            raise ConfigError(
                f"speculative decoding needs a scheduler with set_spec_tokens(), "
                f"pending_prefill_tokens() and running; {type(scheduler).__name__} has not"
            )
        return cast(DraftTarget, scheduler)

    @property
    def stateful(self) -> bool:
        """Whether the drafter keeps per-sequence state (a draft model's KV)."""
        return self._stateful is not None

    def draft(self, scheduler: DraftTarget) -> None:
        """Propose, plan and hand the drafts to ``scheduler`` for its next ``schedule()``.

        Called by the engine before each round is planned, under its lock. Reads the live
        running sequences and the scheduler's estimate of the round's prefill tokens (the
        planner's ``other_tokens``); mutates the scheduler's pending drafts (every drafted sequence
        gets a list, possibly empty, replacing any stale one). O(drafter + planner).
        """
        self._probs.clear()
        running = scheduler.running
        self.sync(running)
        live = [
            r for r in running
            if r.block_table and r.num_computed_tokens == len(r.all_token_ids) - 1
        ]
        if not live:
            return
        for req, drafts in zip(live, self.choose(live, scheduler.pending_prefill_tokens())):
            scheduler.set_spec_tokens(req.request_id, drafts)

    def choose(self, live: Sequence[DraftSequence], other_tokens: int) -> list[list[int]]:
        """The drafts each of ``live`` verifies this round: proposed by the drafter (up to
        γ after each one's ``all_token_ids``), cut by the planner (``other_tokens``: the
        round's prefill tokens). Keeps the round's draft distributions for
        :meth:`draft_probs` (forgetting the previous round's) and counts the totals.

        Called by :meth:`draft` on the host, and by the runner's side of overlapped
        speculation (:class:`~deepinfer_kit.engine.runner.drafting.RunnerDrafting`) when a
        round executes. Mutates the drafter's state (a draft model's KV). O(drafter + planner).
        """
        self._probs.clear()
        if not live:
            return []
        gamma = self.num_draft
        proposal = self.drafter.propose(live, gamma)
        ids: list[list[int]] = proposal.token_ids.tolist()
        probs = proposal.draft_probs
        conf: list[list[float]] = (
            proposal.confidence.tolist() if proposal.confidence is not None
            else [[1.0] * gamma for _ in live]
        )
        seen = conf
        if self.lagged:
            zeros = [0.0] * gamma
            seen = [self._previous.get(r.request_id, zeros) for r in live]
            self._previous = {r.request_id: row for r, row in zip(live, conf)}
        lengths = self.planner.plan(seen, proposal.num_drafted, other_tokens)
        chosen: list[list[int]] = []
        for r, (seq, row, n, made) in enumerate(zip(live, ids, lengths, proposal.num_drafted)):
            self.num_drafted += made
            self.num_planned += n
            chosen.append(row[:n])
            if probs is not None and n:
                self._probs[seq.request_id] = (row[:n], probs[r, :n])
        return chosen

    def draft_probs(self, request_id: str, drafts: Sequence[int]) -> torch.Tensor | None:
        """``[len(drafts), V]`` the distributions ``drafts`` were drawn from, or ``None``
        (a deterministic drafter, or drafts that are not a prefix of this round's).

        Called by the runner while it lays out a verified chunk; read only.
        """
        kept = self._probs.get(request_id)
        if kept is None or len(drafts) > len(kept[0]) or list(drafts) != kept[0][: len(drafts)]:
            return None
        return kept[1][: len(drafts)]

    def sync(self, running: Sequence[DraftSequence]) -> None:
        """Tell a stateful drafter which sequences still run (see
        :meth:`StatefulDrafter.sync`); a no-op for a stateless one.

        Called by the engine after every committed round and before each drafting phase.
        """
        if self._stateful is not None:
            self._stateful.sync(running)

    def check_idle(self) -> None:
        """Raise :class:`~deepinfer_kit.errors.InvariantError` if a stateful drafter still
        holds sequences or blocks (part of the engine's idle check)."""
        if self._stateful is not None:
            self._stateful.check_idle()
