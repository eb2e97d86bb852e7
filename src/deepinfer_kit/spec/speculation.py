"""Speculation: the drafting phase of a round — propose drafts for the decoding sequences
and plan their verification lengths (the runner's :class:`~deepinfer_kit.engine.runner.drafting.RunnerDrafting`
calls it as each round executes); :func:`build_speculation` makes one from a SpecConfig."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.spec.drafters.ngram import NgramDrafter
from deepinfer_kit.spec.planners import DSparkPlanner, FixedPlanner, ThresholdPlanner
from deepinfer_kit.spec.planning import RoundPlanner
from deepinfer_kit.spec.protocols import Drafter, DraftSequence, StatefulDrafter, VerifyPlanner
from deepinfer_kit.spec.records import SpecConfig, SpsCurve
from deepinfer_kit.spec.sps_online import MeasuredSps

__all__ = ["Speculation", "build_speculation", "named_planner"]


class Speculation:
    """Drafts ``num_draft`` (γ) tokens per decoding sequence and plans how many to verify.

    The runner's :class:`~deepinfer_kit.engine.runner.drafting.RunnerDrafting` asks it for
    the drafts of every decode chunk the scheduler planned with room for drafts, fork
    children included, as the round executes. The verification itself is the runner's (a
    :class:`~deepinfer_kit.spec.protocols.DraftVerifier`), and rollback the scheduler's
    (target KV) and the drafter's (its own KV, through :meth:`sync`).

    When the drafter returns ``draft_probs`` (a draft model), each drafted sequence's
    probabilities are kept until the next drafting phase, for the runner to hand to the
    verifier with the drafts it kept (:meth:`draft_probs`).

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
        measured: corrects the DSpark planner's curve from the round times the runner
            measures (:meth:`observe_round`); ``None``: the profiled curve stays (plans
            then never depend on timing).

    Attributes:
        num_drafted, num_planned: totals over the engine's life (drafts proposed, drafts
            sent to verification).
    """

    def __init__(self, drafter: Drafter, planner: VerifyPlanner, num_draft: int, *,
                 lagged: bool = False, measured: MeasuredSps | None = None) -> None:
        self.drafter = drafter
        # resolved once: a runtime Protocol check costs ~50 us, and sync runs twice a round
        self._stateful = drafter if isinstance(drafter, StatefulDrafter) else None
        self.planner = planner
        self.rounds = RoundPlanner(planner, lagged=lagged)
        self.num_draft = num_draft
        self.lagged = lagged
        if measured is not None and not isinstance(planner, DSparkPlanner):
            raise ConfigError(f"an online SPS correction needs the DSpark planner, got {planner!r}")
        self.measured = measured
        self.num_drafted = 0
        self.num_planned = 0
        self._probs: dict[str, tuple[list[int], torch.Tensor]] = {}

    @property
    def stateful(self) -> bool:
        """Whether the drafter keeps per-sequence state (a draft model's KV)."""
        return self._stateful is not None

    def choose(self, live: Sequence[DraftSequence], other_tokens: int) -> list[list[int]]:
        """The drafts each of ``live`` verifies this round: proposed by the drafter (up to
        γ after each one's ``all_token_ids``), cut by the planner (``other_tokens``: the
        round's prefill tokens). Keeps the round's draft distributions for
        :meth:`draft_probs` (forgetting the previous round's) and counts the totals.

        Called by the runner's :class:`~deepinfer_kit.engine.runner.drafting.RunnerDrafting`
        when a round executes. Mutates the drafter's state (a draft model's KV). O(drafter + planner).
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
        lengths = self.rounds.plan([r.request_id for r in live], [len(r.output_token_ids) for r in live], conf,
                                   proposal.num_drafted, other_tokens)
        chosen: list[list[int]] = []
        for r, (seq, row, n, made) in enumerate(zip(live, ids, lengths, proposal.num_drafted)):
            self.num_drafted += made
            self.num_planned += n
            chosen.append(row[:n])
            if probs is not None and n:
                self._probs[seq.request_id] = (row[:n], probs[r, :n])
        return chosen

    def observe_round(self, tokens: int, seconds: float) -> None:
        """A speculative round of ``tokens`` tokens (verified chunks and prefill) took
        ``seconds`` from layout to sampled tokens: with :attr:`measured`, correct the
        planner's curve (:class:`MeasuredSps`); otherwise a no-op. Called by the runner's
        drafting after each round."""
        measured = self.measured
        if measured is not None and measured.observe(tokens, seconds):
            assert isinstance(self.planner, DSparkPlanner)
            self.planner.sps = measured.curve

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

        Called by :class:`~deepinfer_kit.engine.runner.drafting.RunnerDrafting` before each
        round drafts and whenever sequences were released.
        """
        if self._stateful is not None:
            self._stateful.sync(running)

    def check_idle(self) -> None:
        """Raise :class:`~deepinfer_kit.errors.InvariantError` if a stateful drafter still
        holds sequences or blocks (part of the engine's idle check)."""
        if self._stateful is not None:
            self._stateful.check_idle()


def build_speculation(
    spec: SpecConfig | None, drafter: Drafter | None = None, *, sps: SpsCurve | None = None,
    planner: VerifyPlanner | None = None,
) -> Speculation | None:
    """The drafting phase of ``spec`` (``None`` without it): ``drafter`` (default: the
    n-gram drafter of ``spec``; ``engine.drafters.build_drafter`` builds the model
    drafters) and ``planner`` (default: the named one; the DSpark planner's curve is
    ``sps``: ``build_engine`` passes ``spec.sps``, or the curve it profiled). The verifier
    is built beside it (a :class:`RejectionVerifier`), since the runner needs it before the
    curve can be profiled.

    Raises:
        ConfigError: ``planner="dspark"`` without a curve (neither ``sps`` nor an
            ``SpsCurve`` in ``spec.sps``): the planner has nothing to trade drafts against;
            ``spec.sps_online`` with a planner other than the DSpark one.
    """
    if spec is None:
        return None
    if planner is None:
        planner = named_planner(spec, sps)
    if drafter is None:
        drafter = NgramDrafter(spec.ngram_min, spec.ngram_max)
    measured = None
    if spec.sps_online:
        if not isinstance(planner, DSparkPlanner):
            raise ConfigError(f"speculative.sps_online corrects the DSpark planner's curve, got planner {planner!r}")
        measured = MeasuredSps(planner.sps)
    return Speculation(drafter, planner, spec.num_draft, measured=measured)


def named_planner(spec: SpecConfig, sps: SpsCurve | None = None) -> VerifyPlanner:
    """The verify planner ``spec.planner`` names (the DSpark one over ``sps``, else
    ``spec.sps``).

    Raises:
        ConfigError: ``planner="dspark"`` without a curve.
    """
    if spec.planner == "threshold":
        return ThresholdPlanner(spec.threshold, spec.threshold_rule)
    if spec.planner == "dspark":
        curve = sps if sps is not None else spec.sps
        if not isinstance(curve, SpsCurve):
            raise ConfigError(
                f"speculative.sps: planner='dspark' needs an SpsCurve (the engine profiles "
                f"one when it is built), got {curve!r}"
            )
        return DSparkPlanner(curve)
    return FixedPlanner(spec.num_draft)
