"""add_chunk: the snapshot of one sequence's work in a round (a :class:`ScheduledChunk`),
the one builder of chunks for every planning path."""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer_kit.request import Request
from deepinfer_kit.sched.forks import will_fork
from deepinfer_kit.sched.records import SamplingRow, ScheduledChunk
from deepinfer_kit.sched.state import InflightPlan, SchedulerState

__all__ = ["add_chunk"]

_NO_TARGETS: tuple[Sequence[int], int, int] = ((), 0, 0)


def add_chunk(
    state: SchedulerState,
    entry: InflightPlan,
    req: Request,
    start: int,
    n: int,
    placeholders: int = 0,
    num_cached: int = 0,
    pending: int = 0,
    room: int = 0,
) -> int:
    """Append to ``entry`` the chunk feeding ``n`` tokens of ``req`` from ``start`` (the
    last ``placeholders`` of them still being sampled by the step in flight, which may
    still reject ``pending`` drafts before them), then ``room`` drafts for the runner to
    propose; advance ``req.num_computed_tokens`` past it. ``num_cached`` is
    the prefix hit of an admission chunk (traces). Returns the chunk's tokens.

    The chunk samples when it reaches the last known token; that sample forks into ``n``
    completions when it is the request's first (and not a placeholder decode). The token
    ids are copied and the block table is a snapshot (``SchedulerState.tables``: one copy
    shared by the chunks of consecutive rounds until the table changes), so later
    mutations of ``req`` never reach the chunk. Reuses the sequence's
    :class:`SamplingRow` (``SchedulerState.rows``). O(1) per decode round apart from a
    block-table copy once per block (or per allocation).
    """
    all_ids = req.all_token_ids
    end = start + n
    table = state.tables.get(req)
    if table is None:
        table = state.tables[req] = list(req.block_table)
    num_samples = 1
    row = None
    history: Sequence[int] = ()
    if end >= len(all_ids):
        rows = state.rows
        row = rows.get(req)
        if row is None:
            params = req.params
            row = rows[req] = SamplingRow(
                params,
                req.seed,
                req.prompt_token_ids,
                req.eos_token_id,
                bool(params.min_tokens) or params.has_penalties or bool(params.bad_words_token_ids)
                or params.structured_outputs is not None,  # the grammar follows the tokens
            )
        if row.needs_history or room:
            history = tuple(req.output_token_ids)
        fan_out = row.params.n
        if fan_out > 1 and not placeholders and will_fork(req):
            num_samples = fan_out
    total = n + room
    entry.plan.chunks.append(
        ScheduledChunk(
            req.request_id,
            start,
            total,
            all_ids[start:end],  # a placeholder position lies past the known ids
            table,
            row is not None,
            num_samples,
            (),
            1 if placeholders else 0,
            req.num_preemptions,
            row,
            num_cached,
            end - len(req.prompt_token_ids),
            history,
            *_prompt_targets(req, start, end),
            pending,
            room,
        )
    )
    entry.requests.append(req)
    req.num_computed_tokens = start + total
    return total


def _prompt_targets(req: Request, start: int, end: int) -> tuple[Sequence[int], int, int]:
    """``(targets, first, top)`` of a chunk over ``[start, end)`` (see
    ``ScheduledChunk.prompt_targets``): the prompt positions from the first whose logprob
    is not committed yet (a recompute after preemption does not repeat them)."""
    done = req.prompt_logprobs
    if done is None:
        return _NO_TARGETS
    top = req.params.prompt_logprobs
    if top is None:
        return _NO_TARGETS
    prompt = req.prompt_token_ids
    first = max(start, len(done) - 1)
    last = min(end, len(prompt) - 1)
    if first >= last:
        return _NO_TARGETS
    return list(prompt[first + 1 : last + 1]), first, top
