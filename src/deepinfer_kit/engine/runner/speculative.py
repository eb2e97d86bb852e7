"""SpeculativeRunner: speculation as a StepRunner around the plain runner — each round's
plan is resolved against the round before and drafted for when it executes
(:class:`~deepinfer_kit.engine.runner.drafting.RunnerDrafting`), then laid out and run by
the plain :class:`ModelRunner`, which knows nothing of drafting (it verifies the drafts a
chunk carries, reading their distributions through the lookup it was built with)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepinfer_kit.engine.runner.drafting import LateStep, RunnerDrafting
from deepinfer_kit.engine.runner.launched import LaunchedStep
from deepinfer_kit.engine.runner.model_runner import ModelRunner

if TYPE_CHECKING:
    from deepinfer_kit.cache.hybrid_kv import KVStorage
    from deepinfer_kit.engine.protocols import StepRunner
    from deepinfer_kit.engine.runner.balance import ExpertBalancer
    from deepinfer_kit.engine.runner.static_decode import StaticDecode
    from deepinfer_kit.engine.runner.token_slots import TokenSlots
    from deepinfer_kit.models.protocols import CausalLM
    from deepinfer_kit.sample.protocols import Sampler
    from deepinfer_kit.sched.records import SchedulePlan
    from deepinfer_kit.spec.protocols import DraftVerifier
    from deepinfer_kit.step import StepResult

__all__ = ["SpeculativeRunner", "ServingRunner"]


class SpeculativeRunner:
    """A :class:`StepRunner` (and :class:`TwoPhaseRunner`) that speculates.

    :meth:`prepare` only leases the plan's token slots (on the host's thread, as a full
    layout would) and defers the plan (:class:`LateStep`); :meth:`execute` (or
    :meth:`launch`, which runs the round to its end) resolves it against the round before,
    drafts into its chunks' draft room, then has the plain runner lay it out and run it.
    A speculative round never pipelines (it resolves on the host against the round
    before). The model, pool, sampler and the other device parts are the plain runner's,
    read (and, for instrumentation, replaced) through this object.

    Args:
        runner: the plain runner (built with the speculation's ``draft_probs`` lookup).
        drafting: resolves and drafts each round (holds the drafter, planner and γ).
    """

    def __init__(self, runner: ModelRunner, drafting: RunnerDrafting) -> None:
        self.runner = runner
        self.drafting = drafting

    # ---- the plain runner's parts --------------------------------------------------------

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        return self.runner.block_size

    @property
    def num_blocks(self) -> int:
        """Blocks in the KV pool."""
        return self.runner.num_blocks

    @property
    def token_slots(self) -> TokenSlots | None:
        """The plain runner's token slots (overlapped speculation), or ``None``."""
        return self.runner.token_slots

    @property
    def device(self) -> torch.device:
        """The model's device."""
        return self.runner.device

    @property
    def model(self) -> CausalLM:
        """The target model (settable: instrumentation replaces it in the plain runner)."""
        return self.runner.model

    @model.setter
    def model(self, model: CausalLM) -> None:
        self.runner.model = model

    @property
    def sampler(self) -> Sampler:
        """The sampler (settable, as :attr:`model`)."""
        return self.runner.sampler

    @sampler.setter
    def sampler(self, sampler: Sampler) -> None:
        self.runner.sampler = sampler

    @property
    def kv_cache(self) -> KVStorage:
        """The KV pool."""
        return self.runner.kv_cache

    @property
    def static(self) -> StaticDecode | None:
        """The static decode buffers, or ``None``."""
        return self.runner.static

    @property
    def balancer(self) -> ExpertBalancer | None:
        """Live EPLB, or ``None``."""
        return self.runner.balancer

    @property
    def verifier(self) -> DraftVerifier | None:
        """The draft verifier."""
        return self.runner.verifier

    @property
    def generator(self) -> torch.Generator | None:
        """The random source of unseeded requests."""
        return self.runner.generator

    # ---- the round -------------------------------------------------------------------

    def prepare(self, plan: SchedulePlan, *, record_expert_counts: bool = False) -> LateStep:
        """Lease the plan's token slots for this step (every chunk that samples, on the
        host's thread) and defer the layout to :meth:`execute`. Reads the plan only."""
        slots = self.runner.token_slots
        if slots is not None:
            for sid in plan.decodes.request_ids:
                slots.lease(sid, plan.step_id)
            for chunk in plan.chunks:
                if chunk.sample:
                    slots.lease(chunk.request_id, plan.step_id)
        return LateStep(plan, record_expert_counts)

    def execute(self, step: LateStep) -> StepResult:
        """Resolve and draft ``step``'s plan, then lay it out and run it on the plain runner
        (:meth:`RunnerDrafting.run`); returns its result on the plan's chunks. Mutates the
        drafter's state, the KV cache and the token slots. Raises what the round raises."""
        runner, late = self.runner, step.record_expert_counts
        return self.drafting.run(step.plan, lambda plan: runner.execute(runner.prepare(plan, record_expert_counts=late)))

    def pipelines(self, step: LateStep) -> bool:
        """Never: a speculative round resolves against the round before on the host."""
        return False

    def launch(self, step: LateStep) -> LaunchedStep:
        """Run the round to its end (:meth:`execute`); its result waits in the handle."""
        return LaunchedStep(ordinal=0, done=self.execute(step))

    def finish(self, launched: LaunchedStep) -> StepResult:
        """The result :meth:`launch` computed."""
        return self.runner.finish(launched)

    def check_idle(self) -> None:
        """Raise :class:`InvariantError` unless no sequence state is held: the plain runner's
        token slots free (their follower, the drafting, released with them) or, without
        slots, the drafter holding no sequence and no block."""
        self.runner.check_idle()
        if self.runner.token_slots is None:
            self.drafting.check_idle()

    def close(self) -> None:
        """Close the plain runner."""
        self.runner.close()


ServingRunner = ModelRunner | SpeculativeRunner
"""The runner an engine serves with (what ``worker_setup`` hooks receive)."""

if TYPE_CHECKING:
    _check: type[StepRunner] = SpeculativeRunner
