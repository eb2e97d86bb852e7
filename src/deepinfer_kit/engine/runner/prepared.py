"""PreparedStep: one plan laid out for the device by ``ModelRunner.prepare``, what its
``execute`` runs."""

from __future__ import annotations

import attrs
import torch

from deepinfer_kit.engine.runner.prompt_logprobs import PromptRows
from deepinfer_kit.engine.runner.static_decode import StagedDecode
from deepinfer_kit.engine.runner.token_slots import SlotRoutes
from deepinfer_kit.spec.verify.step import VerifiedChunk
from deepinfer_kit.models.records import ForwardBatch
from deepinfer_kit.sample.records import SamplingBatch
from deepinfer_kit.sched.records import SchedulePlan

__all__ = ["PreparedStep"]


@attrs.define(slots=True, eq=False)
class PreparedStep:
    """One plan laid out for the device.

    Attributes:
        plan: the plan it was built from.
        forward: the model's inputs (on the model's device), or ``None`` for a decode
            round staged for the static buffers (``staged``).
        staged: the host layout of a static-shape decode round, or ``None``.
        logits_rows: per sampling row, the batch row whose logits it draws from.
        sampling: one row per drawn token (forks draw several rows from one position).
        row_counts: per chunk, rows drawn (0 for a non-final prefill chunk).
        routes: the placeholders this step gathers from the token slots and the rows it
            scatters into them (see :class:`TokenSlots`); resolved on the device by
            :meth:`ModelRunner.execute`.
        placeholder_rows: ``(sampling row, sequence id)`` of rows whose token history
            (penalties, ``min_tokens``) must include that in-flight token (appended on
            the host from the previous step's copy back).
        grammar_rows: ``(sampling row, sequence id)`` of rows under a structured-output
            grammar (their histories are whole: ``SamplingRow.needs_history``); the
            runner's :class:`~deepinfer_kit.engine.runner.grammar_stage.GrammarStage`
            masks them.
        verified: the chunks whose drafts this round verifies (``1 + len(drafts)`` rows
            each), in row order.
        prompt: the prompt-logprob rows (logits rows after the sampling rows).
        slot_tail: ``routes.tail()`` on the device (a view of the eager step's input
            copy), or ``None`` for a staged round (its tail comes with the load).
        record_expert_counts: return the round's MoE routing counts (traces).
    """

    plan: SchedulePlan
    forward: ForwardBatch | None
    sampling: SamplingBatch
    row_counts: list[int]
    logits_rows: list[int] = attrs.field(factory=list)
    staged: StagedDecode | None = None
    routes: SlotRoutes = attrs.field(factory=SlotRoutes)
    placeholder_rows: list[tuple[int, str]] = attrs.field(factory=list)
    grammar_rows: list[tuple[int, str]] = attrs.field(factory=list)
    verified: list[VerifiedChunk] = attrs.field(factory=list)
    prompt: PromptRows = attrs.field(factory=PromptRows)
    slot_tail: torch.Tensor | None = None
    record_expert_counts: bool = False
