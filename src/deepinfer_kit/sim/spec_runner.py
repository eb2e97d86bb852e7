"""Speculative decoding in the simulator: a synthetic drafter, and a runner that drafts the
way the engine's runner does (the engine's own :class:`RunnerDrafting` over a
``Speculation``: the drafter, then the real planner choosing ``ℓ_r``, into the room the
real scheduler reserved) and verifies. Imports torch (the drafter's ``DraftProposal``
holds tensors), so it is not re-exported by ``deepinfer_kit.sim``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from deepinfer_kit.engine.runner.drafting import RunnerDrafting
from deepinfer_kit.spec.speculation import Speculation
from deepinfer_kit.errors import ConfigError, InvariantError
from deepinfer_kit.sched.protocols import DraftRoom
from deepinfer_kit.sim.records import SimStep
from deepinfer_kit.sim.runner import SimRunner
from deepinfer_kit.spec.records import DraftProposal

if TYPE_CHECKING:
    from deepinfer_kit.engine.config import EngineConfig
    from deepinfer_kit.sim.acceptance import AcceptanceModel
    from deepinfer_kit.sim.cost_analytic import ModelShape
    from deepinfer_kit.sim.protocols import CostModel
    from deepinfer_kit.sched.records import SchedulePlan
    from deepinfer_kit.sim.simulator import Simulator
    from deepinfer_kit.sim.tokens import SyntheticTokens
    from deepinfer_kit.spec.protocols import DraftSequence, VerifyPlanner
    from deepinfer_kit.spec.records import SpecConfig
    from deepinfer_kit.step import StepResult
    from deepinfer_kit.spec.protocols import Drafter

__all__ = ["SyntheticDrafter", "SpecSimRunner", "speculate", "speculate_as_configured", "check_idle"]


class SyntheticDrafter:
    """Drafts the synthetic target's tokens, right or wrong as an :class:`AcceptanceModel`
    draws them, with the model's reported confidences.

    The draft at depth ``j`` of a request whose next sample is output position ``q`` is
    the target's token ``tokens.token(id, q + j)`` when ``acceptance.draft_is_right(id, q,
    j)``, else another id (never EOS). Verification then accepts exactly the drafts before
    the first wrong one. Deterministic: the same request and position give the same drafts
    in any batch.

    Args:
        acceptance: draws which drafts are right and what the drafter reports.
        tokens: the target's tokens (the simulator's :class:`SyntheticTokens`).
    """

    def __init__(self, acceptance: AcceptanceModel, tokens: SyntheticTokens) -> None:
        self.acceptance = acceptance
        self.tokens = tokens

    def propose(self, requests: Sequence[DraftSequence], num_draft: int) -> DraftProposal:
        """See :meth:`Drafter.propose`: ``[R, γ]`` drafts and confidences, ``γ`` each.
        Reads each request's id and output count; mutates only the acceptance model's
        per-request cache. O(R · γ)."""
        acc, token = self.acceptance, self.tokens.token
        span = self.tokens.vocab_size
        eos = self.tokens.eos_token_id
        ids: list[list[int]] = []
        conf: list[list[float]] = []
        for req in requests:
            rid, q = req.request_id, len(req.output_token_ids)
            row: list[int] = []
            for j in range(num_draft):
                t = token(rid, q + j)
                if not acc.draft_is_right(rid, q, j):
                    t = (t + 1) % span
                    if t == eos:
                        t = (t + 1) % span
                row.append(t)
            ids.append(row)
            conf.append([acc.reported(rid, q, j) for j in range(num_draft)])
        shape = (len(requests), num_draft)
        return DraftProposal(
            token_ids=torch.tensor(ids, dtype=torch.int64).reshape(shape),
            num_drafted=[num_draft] * len(requests),
            confidence=torch.tensor(conf, dtype=torch.float32).reshape(shape),
        )


class SpecSimRunner(SimRunner):
    """A :class:`SimRunner` that drafts as the engine's runner does and verifies as the
    greedy verifier does: each plan's decode chunks are resolved and drafted for by
    ``drafting`` (:class:`RunnerDrafting`, the engine's one drafting path), the resolved
    round is priced, and a verified chunk returns its drafts up to the first one that
    differs from the synthetic target's token, then the target's token (the recovered
    one, or the bonus when all are right), with ``num_drafted`` / ``num_accepted`` and the
    drafts per chunk like the real runner's StepResult.

    Args:
        cost, tokens: as :class:`SimRunner`.
        drafting: the drafting phase over a drafter of ``tokens``.
    """

    __slots__ = ("drafting", "_results")

    def __init__(self, cost: CostModel, tokens: SyntheticTokens, drafting: RunnerDrafting) -> None:
        super().__init__(cost, tokens)
        self.drafting = drafting
        self._results: dict[int, StepResult] = {}

    def prepare(self, plan: SchedulePlan) -> SimStep:
        """Resolve and draft ``plan`` (:meth:`RunnerDrafting.run`), price the resolved
        round and verify it; the step's result waits for :meth:`execute`. O(chunks +
        drafter + planner + verified drafts)."""
        priced: list[SimStep] = []

        def run(resolved: SchedulePlan) -> StepResult:
            step = SimRunner.prepare(self, resolved)
            priced.append(step)
            return self._verify(step)

        self._results[plan.step_id] = self.drafting.run(plan, run)
        return SimStep(plan, priced[0].shape, priced[0].duration)

    def execute(self, step: SimStep) -> StepResult:
        """The result :meth:`prepare` computed for ``step``."""
        return self._results.pop(step.plan.step_id)

    def _verify(self, step: SimStep) -> StepResult:
        """See :meth:`SimRunner.execute`; verified chunks get ``accepted + 1`` tokens.
        O(chunks + verified drafts)."""
        result = SimRunner.execute(self, step)
        token = self.tokens.token
        drafted: list[int] = []
        accepted: list[int] = []
        for i, chunk in enumerate(step.plan.chunks):
            spec = chunk.spec_token_ids
            if not spec or not chunk.sample:
                drafted.append(0)
                accepted.append(0)
                continue
            rid, q = chunk.request_id, chunk.output_position
            n = 0
            while n < len(spec) and spec[n] == token(rid, q + n):
                n += 1
            result.token_ids[i] = [token(rid, q + j) for j in range(n + 1)]
            drafted.append(len(spec))
            accepted.append(n)
        if any(drafted):
            result.num_drafted, result.num_accepted = drafted, accepted
        return result


def speculate(sim: Simulator, speculation: Speculation) -> None:
    """Make ``sim`` speculate with ``speculation``: its runner becomes a
    :class:`SpecSimRunner` drafting through the engine's :class:`RunnerDrafting` (drafts
    verified against the synthetic target's tokens), and its scheduler reserves room for
    ``speculation.num_draft`` drafts. Called once, before the run; mutates ``sim``.

    Raises:
        ConfigError: the scheduler reserves no room for drafts.
    """
    if not isinstance(sim.scheduler, DraftRoom):
        raise ConfigError(f"speculation needs a scheduler with reserve_drafts(); "
                          f"{type(sim.scheduler).__name__} has none")
    sim.runner = SpecSimRunner(sim.runner.cost, sim.runner.tokens, RunnerDrafting(speculation))
    sim.scheduler.reserve_drafts(speculation.num_draft)


def speculate_as_configured(sim: Simulator, spec: SpecConfig, drafter: Drafter | None,
                            planner: VerifyPlanner | None) -> None:
    """Make ``sim`` speculate as ``spec`` says, with ``drafter`` (else the n-gram drafter
    ``spec`` names) and ``planner`` (else the named one): :func:`speculate`.

    Raises:
        ConfigError: a model drafter named (the simulator runs no model), or as
            :func:`speculate` and ``named_planner``.
    """
    from deepinfer_kit.spec.drafters.ngram import NgramDrafter
    from deepinfer_kit.spec.speculation import named_planner

    if drafter is None:
        if spec.drafter != "ngram":
            raise ConfigError(f"speculative.drafter={spec.drafter!r} drafts with a model, which the "
                              f"simulator has none of: use 'ngram' or give components.drafter")
        drafter = NgramDrafter(spec.ngram_min, spec.ngram_max)
    speculate(sim, Speculation(drafter, planner if planner is not None else named_planner(spec), spec.num_draft))


def check_idle(sim: Simulator) -> None:
    """Raise :class:`InvariantError` unless the simulated engine holds no request and
    every block is back in the pool (free or cached with reference count 0), and the
    cache manager's integrity check passes. Called after a run; reads only."""
    if sim.scheduler.has_unfinished():
        raise InvariantError("the simulator's scheduler still holds requests")
    cache = sim.cache
    free = cache.num_free_blocks
    if free != cache.num_blocks:
        raise InvariantError(f"{cache.num_blocks - free} blocks still referenced with no request live")
    cache.check_integrity()


if TYPE_CHECKING:
    _drafter: type[Drafter] = SyntheticDrafter
