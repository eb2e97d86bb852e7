"""RoundLayout: a plan's chunks as the host lists of one flattened batch — input tokens,
positions, block tables, the logits row and sampling parameters of every row drawn, the
token-slot routes of placeholders, the verified chunks and the prompt-logprob rows.

:meth:`~deepinfer_kit.engine.runner.model_runner.ModelRunner.prepare` builds one per round
(:func:`lay_out`) and turns it into device tensors (eager) or stages it for the static
decode buffers. Row rules:

- a chunk that samples draws ``num_samples`` rows from its last position (fork children
  after the sequence's own row, each with its fork seed);
- a chunk with drafts draws ``1 + len(drafts)`` rows, row ``j`` from the logits after
  draft ``j - 1`` at output position ``output_position + j``, its history given by
  :func:`~deepinfer_kit.spec.verify.rows.row_histories` (the verifiers' own rule);
- a placeholder (a token the step in flight samples) is an input hole filled on the
  device from the sequence's token slot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

from deepinfer_kit.engine.runner.prompt_logprobs import PromptRows
from deepinfer_kit.engine.runner.token_slots import HOLE_FILL, SlotRoutes, TokenSlots
from deepinfer_kit.errors import InvariantError
from deepinfer_kit.request import fork_seed
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sample.records import SamplingBatch
from deepinfer_kit.sched.records import DecodeRows, ScheduledChunk, SchedulePlan
from deepinfer_kit.spec.verify.rows import row_histories
from deepinfer_kit.spec.verify.step import VerifiedChunk

__all__ = ["DraftProbs", "RoundLayout", "lay_out", "lay_out_chunks", "lay_out_rows"]

#: ``(sequence id, drafts) -> [len(drafts), V]`` the distributions a model drafter drew the
#: drafts from, or ``None`` (one-hot drafts).
DraftProbs = Callable[[str, Sequence[int]], "torch.Tensor | None"]


@attrs.define(slots=True, eq=False)
class RoundLayout:
    """The host lists of one round (see the module docstring). ``T`` tokens, ``C`` chunks,
    ``N`` sampling rows."""

    input_ids: list[int] = attrs.field(factory=list)  # [T]
    positions: list[int] = attrs.field(factory=list)  # [T]
    query_lens: list[int] = attrs.field(factory=list)  # [C]
    seq_lens: list[int] = attrs.field(factory=list)  # [C]
    tables: list[list[int]] = attrs.field(factory=list)  # [C] block tables
    logits_rows: list[int] = attrs.field(factory=list)  # [N] batch row of each sampling row
    row_counts: list[int] = attrs.field(factory=list)  # [C] rows drawn per chunk
    params: list[SamplingParams] = attrs.field(factory=list)  # [N]
    seeds: list[int | None] = attrs.field(factory=list)  # [N]
    out_pos: list[int] = attrs.field(factory=list)  # [N]
    prompts: list[Sequence[int]] = attrs.field(factory=list)  # [N]
    outputs: list[Sequence[int]] = attrs.field(factory=list)  # [N]
    eos: list[int | None] = attrs.field(factory=list)  # [N]
    routes: SlotRoutes = attrs.field(factory=SlotRoutes)
    hole_rows: list[tuple[int, str]] = attrs.field(factory=list)  # rows whose history needs the hole's token
    grammar_rows: list[tuple[int, str]] = attrs.field(factory=list)  # (row, sequence id) under a grammar
    verified: list[VerifiedChunk] = attrs.field(factory=list)
    prompt: PromptRows = attrs.field(factory=PromptRows)
    shared_rows: list[int] = attrs.field(factory=list)  # rows a bounded replay recomputes before its hit

    @property
    def num_tokens(self) -> int:
        """Tokens laid out so far."""
        return len(self.input_ids)

    def sampling(self, generator: torch.Generator | None) -> SamplingBatch:
        """The sampling rows as one batch (the lists are shared, not copied)."""
        return SamplingBatch(params=self.params, seeds=self.seeds, positions=self.out_pos,
                             prompt_token_ids=self.prompts, output_token_ids=self.outputs,
                             eos_token_ids=self.eos, generator=generator)

    def add_row(self, logits_row: int, chunk: ScheduledChunk, seed: int | None, position: int,
                history: Sequence[int]) -> None:
        """One sampling row of ``chunk`` (which must have a sampling row)."""
        row = chunk.sampling
        assert row is not None
        if row.params.structured_outputs is not None:
            self.grammar_rows.append((len(self.params), chunk.request_id))
        self.logits_rows.append(logits_row)
        self.params.append(row.params)
        self.seeds.append(seed)
        self.out_pos.append(position)
        self.prompts.append(row.prompt_token_ids)
        self.outputs.append(history)
        self.eos.append(row.eos_token_id)


def lay_out(plan: SchedulePlan, *, step_id: int, slots: TokenSlots | None, can_verify: bool,
            draft_probs: DraftProbs | None) -> RoundLayout:
    """The :class:`RoundLayout` of ``plan``'s batch: its decode rows column by column
    (:func:`lay_out_rows`), then its chunk records (:func:`lay_out_chunks`); leases token
    slots (``step_id``) for placeholders and for every sequence that samples.
    O(T + R * max_blocks).

    Raises:
        InvariantError: a chunk with more than one placeholder, a placeholder together
            with drafts, a placeholder without token slots, drafts on a fork or without a
            verifier (``can_verify``), or no token slot free.
    """
    rows = plan.decodes
    if not rows.request_ids:
        return lay_out_chunks(plan.chunks, step_id, slots, can_verify, draft_probs)
    out = lay_out_rows(rows, step_id, slots)
    if plan.chunks:
        lay_out_chunks(plan.chunks, step_id, slots, can_verify, draft_probs, out=out, first=len(rows))
    return out


def lay_out_chunks(chunks: Sequence[ScheduledChunk], step_id: int, slots: TokenSlots | None,
                   can_verify: bool, draft_probs: DraftProbs | None, *, out: RoundLayout | None = None,
                   first: int = 0) -> RoundLayout:
    """:func:`lay_out`'s general path, chunk by chunk (any chunks; the reference of its
    column-wise path for decode rows), appended to ``out`` (a new layout when ``None``)
    whose batch already holds ``first`` chunks. Returns the layout. Raises as
    :func:`lay_out`."""
    out = RoundLayout() if out is None else out
    for index, chunk in enumerate(chunks, first):
        _add_tokens(out, chunk, step_id, slots)
        out.prompt.add(index, chunk, out.num_tokens - chunk.num_tokens)
        if chunk.sampling is None:
            out.row_counts.append(0)
        elif chunk.spec_token_ids:
            _add_verified(out, index, chunk, can_verify, draft_probs)
        else:
            _add_sampled(out, chunk, step_id, slots)
    return out


def _add_tokens(out: RoundLayout, chunk: ScheduledChunk, step_id: int, slots: TokenSlots | None) -> None:
    """The chunk's inputs, positions, lengths and block table (a placeholder as a hole)."""
    start, n = chunk.start, chunk.num_tokens
    if chunk.num_cached_tokens > start:  # a bounded replay: its full-layer K/V is the cache's
        base = len(out.input_ids)
        out.shared_rows.extend(range(base, base + min(n, chunk.num_cached_tokens - start)))
    out.input_ids.extend(chunk.token_ids)
    if chunk.num_placeholders:
        if chunk.num_placeholders != 1 or chunk.spec_token_ids:
            raise InvariantError(
                f"chunk of {chunk.request_id}: {chunk.num_placeholders} placeholders "
                f"with {len(chunk.spec_token_ids)} drafts; one placeholder and no "
                f"drafts are supported"
            )
        if slots is None:
            raise InvariantError(f"chunk of {chunk.request_id}: a placeholder, and no token slots")
        held = slots.slot_of(chunk.request_id)
        routes = out.routes
        routes.hole_inputs.append(len(out.input_ids))
        routes.hole_slots.append(slots.invalid_slot if held is None else slots.lease(chunk.request_id, step_id))
        routes.hole_rows.append(len(out.params))
        out.input_ids.append(HOLE_FILL)  # resolved in execute, before the forward reads it
    out.input_ids.extend(chunk.spec_token_ids)
    out.positions.extend(range(start, start + n))
    out.query_lens.append(n)
    out.seq_lens.append(start + n)
    out.tables.append(chunk.block_table)


def _add_verified(out: RoundLayout, index: int, chunk: ScheduledChunk, can_verify: bool,
                  draft_probs: DraftProbs | None) -> None:
    """``1 + len(drafts)`` rows of a chunk whose drafts this round verifies."""
    spec = chunk.spec_token_ids
    if chunk.num_samples != 1 or not can_verify:
        raise InvariantError(
            f"chunk of {chunk.request_id}: drafts with {chunk.num_samples} samples and "
            f"{'a' if can_verify else 'no'} verifier; one sample and a verifier needed"
        )
    row = chunk.sampling
    assert row is not None
    probs = draft_probs(chunk.request_id, spec) if draft_probs is not None else None
    out.verified.append(VerifiedChunk(index, len(out.params), tuple(spec), probs))
    out.row_counts.append(len(spec) + 1)
    last = out.num_tokens - len(spec) - 1
    base = tuple(chunk.output_token_ids)
    histories = row_histories(base, spec) if row.needs_history else [base] * (len(spec) + 1)
    for j, history in enumerate(histories):
        out.add_row(last + j, chunk, row.seed, chunk.output_position + j, history)


def _add_sampled(out: RoundLayout, chunk: ScheduledChunk, step_id: int, slots: TokenSlots | None) -> None:
    """``num_samples`` rows drawn from the chunk's last position; the sequence's own row
    writes its token slot."""
    rows = chunk.num_samples
    row = chunk.sampling
    assert row is not None
    out.row_counts.append(rows)
    if slots is not None:  # the first row is the sequence's own (fork children come later)
        out.routes.write_slots.append(slots.lease(chunk.request_id, step_id))
        out.routes.write_rows.append(len(out.params))
    if chunk.num_placeholders and row.needs_history:
        out.hole_rows.extend((len(out.params) + i, chunk.request_id) for i in range(rows))
    last = out.num_tokens - 1
    for i in range(rows):
        out.add_row(last, chunk, fork_seed(row.seed, i) if rows > 1 else row.seed,
                    chunk.output_position, chunk.output_token_ids)


def lay_out_rows(rows: DecodeRows, step_id: int, slots: TokenSlots | None) -> RoundLayout:
    """The :class:`RoundLayout` of a plan's decode rows (:class:`DecodeRows`), column by
    column: what :func:`lay_out_chunks` gives for the same rows as records
    (:meth:`DecodeRows.to_chunks`), and the same token-slot leases in the same order,
    without a chunk object per row. O(R) comprehensions."""
    n = len(rows.request_ids)
    samplers = rows.sampling
    starts = rows.starts
    out = RoundLayout(
        input_ids=list(rows.token_ids),
        positions=list(starts),
        query_lens=[1] * n,
        seq_lens=[s + 1 for s in starts],
        tables=list(rows.block_tables),
        logits_rows=list(range(n)),
        row_counts=[1] * n,
        params=[r.params for r in samplers],
        seeds=[r.seed for r in samplers],
        out_pos=list(rows.output_positions),
        prompts=[r.prompt_token_ids for r in samplers],
        outputs=[()] * n,
        eos=[r.eos_token_id for r in samplers],
    )
    if slots is not None:
        routes = out.routes
        lease = slots.lease
        routes.write_slots = [lease(sid, step_id) for sid in rows.request_ids]
        routes.write_rows = list(range(n))
    return out
