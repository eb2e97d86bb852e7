"""Contracts of the spec package: Drafter, VerifyPlanner, DraftVerifier."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.spec.records import DraftProposal, VerifyResult, VerifyRows

__all__ = ["DraftSequence", "Drafter", "StatefulDrafter", "VerifyPlanner", "BudgetedPlanner", "DraftVerifier"]


class DraftSequence(Protocol):
    """What a drafter reads of a sequence: a live :class:`~deepinfer_kit.request.Request`
    (host-side drafting), or the runner's view of a planned chunk (overlapped drafting,
    :class:`~deepinfer_kit.spec.records.DraftView`). Read only."""

    @property
    def request_id(self) -> str:
        """The sequence's id (a fork child's is ``"{parent}#{index}"``)."""
        ...

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        """The prompt."""
        ...

    @property
    def output_token_ids(self) -> Sequence[int]:
        """The tokens generated so far (the drafts continue after them)."""
        ...

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by the generated tokens."""
        ...

    @property
    def params(self) -> SamplingParams:
        """The sequence's sampling parameters (sampled drafts follow them)."""
        ...

    @property
    def seed(self) -> int | None:
        """The seed the sequence samples with, or ``None``."""
        ...

    @property
    def eos_token_id(self) -> int | None:
        """The model's EOS id (``min_tokens`` masks it), or ``None``."""
        ...


class Drafter(Protocol):
    """Proposes cheap guesses of a request's next tokens."""

    def propose(self, requests: Sequence[DraftSequence], num_draft: int) -> DraftProposal:
        """Draft up to ``num_draft`` (γ) tokens after each request's current tokens.

        Called once per round before the verify forward; reads ``all_token_ids`` and
        mutates only the drafter's own state (e.g. a draft model's KV).
        """
        ...


@runtime_checkable
class StatefulDrafter(Drafter, Protocol):
    """A drafter that keeps per-sequence state between rounds (a draft model's own KV).

    The engine tells it which sequences are still running after every committed round, so
    it can roll its state back to the tokens actually accepted and release the state of
    sequences that finished, were aborted or were preempted.
    """

    def sync(self, running: Sequence[DraftSequence]) -> None:
        """Keep state only for ``running`` (the scheduler's running sequences), each rolled
        back to what its ``all_token_ids`` still agree with; release everything else.

        Called by the engine after each committed round and before each drafting phase.
        Mutates only the drafter's own state; never raises for unknown ids.
        """
        ...

    def check_idle(self) -> None:
        """Raise :class:`~deepinfer_kit.errors.InvariantError` unless the drafter holds no
        sequence state and all of its KV blocks are free (the engine's idle check)."""
        ...


class VerifyPlanner(Protocol):
    """Chooses how many drafts each request verifies this round (``ℓ_r``)."""

    def plan(self, confidence: Sequence[Sequence[float]], max_lengths: Sequence[int],
             other_tokens: int = 0) -> list[int]:
        """Verification lengths for ``R`` requests.

        Args:
            confidence: ``[R][γ]`` per-position acceptance estimates in ``[0, 1]``.
            max_lengths: ``[R]`` drafts available per request (``<= γ``).
            other_tokens: tokens the round feeds besides the ``R`` verified chunks (the
                prefill chunks planned alongside them); a hardware-aware planner counts
                them in the round's size, others ignore them.

        Returns:
            ``[R]`` lengths, each in ``[0, max_lengths[r]]``. Pure host logic.
        """
        ...


@runtime_checkable
class BudgetedPlanner(VerifyPlanner, Protocol):
    """A verify planner that can take the round's total from other confidences than the
    ones it ranks with (a budget from earlier rounds, as DeepInfer's planner does):
    :class:`~deepinfer_kit.spec.planning.RoundPlanner` calls :meth:`plan_budgeted`
    instead of :meth:`plan` when the planner has it."""

    def plan_budgeted(self, confidence: Sequence[Sequence[float]], max_lengths: Sequence[int],
                      other_tokens: int, budget_confidence: Sequence[Sequence[float]]) -> list[int]:
        """Verification lengths for ``R`` requests whose total is decided by
        ``budget_confidence`` and whose split among requests by ``confidence``.

        Args:
            confidence: ``[R][γ]`` this round's per-position acceptance estimates.
            max_lengths: ``[R]`` drafts available per request (``<= γ``).
            other_tokens: the round's other (prefill) tokens, as in :meth:`plan`.
            budget_confidence: ``[R][*]`` estimates that read nothing drawn this round
                (each request's confidences from its previous round); they alone may
                decide the total, since a total read from this round's later confidences
                would let draft ``j``'s value decide whether draft ``j`` is verified.

        Returns:
            ``[R]`` lengths, each in ``[0, max_lengths[r]]``. Pure host logic.
        """
        ...


class DraftVerifier(Protocol):
    """Accepts a prefix of each request's drafts against the target model's logits."""

    def verify(self, rows: VerifyRows, draft_probs: torch.Tensor | None = None) -> VerifyResult:
        """Verify every request's drafts from the flat rows the runner laid out.

        Called once per round that verifies drafts, on the executing thread, after the
        forward; mutates nothing but the unseeded rows' generator.

        Args:
            rows: request ``r`` owns rows ``offsets[r] .. offsets[r] + ℓ_r`` of
                ``rows.logits`` (``[M, V]``, any device) and ``rows.batch``: row ``j`` is
                the target after draft ``j - 1``, drawing output position ``q_r + j``
                (see :class:`~deepinfer_kit.spec.records.VerifyRows`).
            draft_probs: ``[R, G, V]`` (``G >= ℓ_r``) the distributions each request's
                drafts were drawn from, on the rows' device; ``None`` for one-hot
                (deterministic) drafts.

        Returns:
            Accepted drafts plus one recovered / bonus token per request. Greedy rows
            equal plain greedy decoding; sampled rows preserve the target distribution.

        Raises:
            InvariantError: rows, offsets and drafts that disagree.
        """
        ...
