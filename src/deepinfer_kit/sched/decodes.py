"""The plain-decode fast path of both phases of a round: planning a run of plain decodes
as rows of the plan's columns (``SchedulePlan.decodes``; their new blocks in one cache
call) and committing those rows in bulk.

A plain decode feeds a sequence's last known token, with no drafts, nothing shared and
no draft room: the common round of a sequence. Both loops here run once per decoding
sequence and round, so they do without the general paths' tests; anything unusual
(a fork's first sample, a token count that is not one, an error, logprobs, a shift) is
left to the general path, which makes the same decisions.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

from deepinfer_kit.errors import InvariantError
from deepinfer_kit.request import Request, RequestStatus
from deepinfer_kit.sched.chunks import add_chunk
from deepinfer_kit.sched.records import SamplingRow
from deepinfer_kit.sched.state import InflightPlan, SchedulerState
from deepinfer_kit.sched.stops import check_stop, length_limit

__all__ = ["plan_decodes", "commit_decodes", "fast_path_row", "stop_rule"]

_RUNNING = RequestStatus.RUNNING
_FINISHED = RequestStatus.FINISHED


def plan_decodes(state: SchedulerState, entry: InflightPlan, i: int, budget: int) -> tuple[int, int]:
    """Plan the plain decodes at ``running[i:]``, in order, up to the first sequence that
    is not one or until ``budget`` is spent; returns the updated ``(i, budget)``.

    A plain decode feeds the last known token (``start + 1 == len(all_token_ids)``),
    with no drafts and nothing shared. One whose token opens a new block is in the run
    too while the cache has a block for it (``num_free_blocks``, unchanged by the run):
    after the loop the run's new blocks come from one
    :meth:`~deepinfer_kit.cache.protocols.KVCacheManager.allocate_next_blocks` call — the
    blocks per-sequence allocations in the same order would give — and their rows take
    the new tables. The first that finds no block ends the run (the general path
    preempts for it). When the sequence's row needs no history, no fork and no prompt
    logprobs (:func:`fast_path_row`) the decode is a row of ``entry.plan.decodes``
    (columns, no chunk object; its sequence in ``entry.decode_requests`` and its place
    in the planning order in ``entry.plain``); otherwise it is the record
    :func:`add_chunk` builds.
    """
    if state.draft_room:  # every decode reserves draft room: the general path sizes it
        return i, budget
    running = state.running
    cache = state.cache
    block_size = cache.block_size
    may_share = state.may_share  # may hold a sequence: test each one
    plain_rows = state.plain_rows
    tables = state.tables
    cols = entry.plan.decodes
    ids, starts, tokens, snapshots = cols.request_ids, cols.starts, cols.token_ids, cols.block_tables
    epochs, rows, outs = cols.preemption_epochs, cols.sampling, cols.output_positions
    records = entry.plan.chunks
    requests = entry.decode_requests
    begin = len(ids)  # the first row of the current planning-order range
    at = len(records)
    grow: list[int] = []  # rows whose sequence opens a new block (``~k``: record k)
    spare = -1  # blocks the cache can give; read at the first sequence that needs one
    done = 0
    for req in islice(running, i, i + budget):
        start = req.num_computed_tokens
        all_ids = req.all_token_ids
        if start + 1 != len(all_ids) or (may_share and req in may_share):
            break
        table = req.block_table
        if start >= len(table) * block_size:
            if not table:
                break  # no blocks yet: the general path matches its prefix first
            if spare < 0:
                spare = cache.num_free_blocks
            if len(grow) >= spare:
                break
            grow.append(len(ids))
        done += 1
        row = plain_rows.get(req)
        if row is None:
            row = fast_path_row(state, req)
            if row is None:
                if len(ids) > begin:
                    entry.plain.append((begin, len(ids), at))
                begin = len(ids)
                if grow and grow[-1] == len(ids):
                    grow[-1] = ~len(records)
                add_chunk(state, entry, req, start, 1)
                at = len(records)
                continue
        snapshot = tables.get(req)
        if snapshot is None:
            snapshot = tables[req] = list(table)
        ids.append(req.request_id)
        starts.append(start)
        tokens.append(all_ids[start])
        snapshots.append(snapshot)
        epochs.append(req.num_preemptions)
        rows.append(row)
        outs.append(start + 1 - len(req.prompt_token_ids))
        requests.append(req)
        req.num_computed_tokens = start + 1
    if grow:
        _grow_tables(state, entry, grow)
    if len(ids) > begin:
        entry.plain.append((begin, len(ids), at))
    return i + done, budget - done


def fast_path_row(state: SchedulerState, req: Request) -> SamplingRow | None:
    """``req``'s sampling row when its plain decodes are decode rows (no history, no
    fork, no prompt logprobs: fixed for the sequence), recorded in
    ``state.plain_rows``; ``None`` while it has no row yet or never qualifies."""
    row = state.plain_rows.get(req)
    if row is None:
        row = state.rows.get(req)
        if row is None or row.needs_history or row.params.n > 1 or req.prompt_logprobs is not None:
            return None
        state.plain_rows[req] = row
    return row


def _grow_tables(state: SchedulerState, entry: InflightPlan, grow: list[int]) -> None:
    """One new block for the sequence of each decode row ``j`` in ``grow`` (``~k``: of the
    record ``entry.plan.chunks[k]``), from one cache call in that order; those rows and
    records (and ``state.tables``) take a snapshot of the grown table.

    Raises:
        InvariantError: the cache gave fewer blocks than it said it had.
    """
    snapshots, requests, tables = entry.plan.decodes.block_tables, entry.decode_requests, state.tables
    records, record_requests = entry.plan.chunks, entry.requests
    growing: Sequence[Request] = [requests[j] if j >= 0 else record_requests[~j] for j in grow]
    got = state.cache.allocate_next_blocks(growing)
    if got != len(grow):
        raise InvariantError(
            f"allocate_next_blocks gave {got} of {len(grow)} blocks it reported free"
        )
    for j, req in zip(grow, growing):
        snapshot = tables[req] = list(req.block_table)
        if j >= 0:
            snapshots[j] = snapshot
        else:
            records[~j].block_table = snapshot


def commit_decodes(
    state: SchedulerState, entry: InflightPlan, token_ids: Sequence[list[int]], a: int, b: int,
    finished: list[Request],
) -> int:
    """Commit the decode rows ``[a, b)`` of ``entry`` (``entry.plan.decodes``; the row's
    tokens are ``token_ids[row]``: the batch lays the rows out first) in bulk: per row
    whose sequence is still running and was not preempted since, append its token, apply
    the stop rules (``check_stop`` runs only for a token that may end the sequence: a stop
    id or EOS, the length limit, or any token under an observer; :func:`stop_rule`),
    publish the block its token filled, and add the sequences that finished to
    ``finished``.

    Returns the first row left for the general path (a token count other than one: it
    raises there), or ``b``. Call only without errors, logprobs, prompt logprobs or
    shifts in the round's result. O(b - a).
    """
    rows = entry.plan.decodes
    cache = state.cache
    block_size = cache.block_size
    max_len = state.config.max_model_len
    rules = state.stop_rules
    clock = state.clock
    j = a - 1
    for req, epoch, start, tokens in zip(entry.decode_requests[a:b], rows.preemption_epochs[a:b],
                                         rows.starts[a:b], token_ids[a:b]):
        j += 1
        if req.status is not _RUNNING or req.num_preemptions != epoch:
            continue  # aborted, finished by an earlier commit, or preempted since
        if len(tokens) != 1:
            return j
        token = tokens[0]
        all_ids = req.all_token_ids
        all_ids.append(token)
        req.output_token_ids.append(token)
        rule = rules.get(req)
        if rule is None:  # its first bulk commit: stamp the first token here, once
            rule = rules[req] = stop_rule(req, max_len)
            metrics = req.metrics
            if metrics is not None and metrics.first_token_time is None:
                metrics.first_token_time = clock()
        if (token in rule[0] or len(all_ids) >= rule[1]) and check_stop(req, token, max_len):
            finished.append(req)
        end = start + 1
        if not end % block_size:
            cache.cache_full_blocks(req, end)
    return b


def stop_rule(req: Request, max_model_len: int) -> tuple[frozenset[int], int]:
    """``(ids, check_from)``: the tokens that may end ``req`` (its stop ids and its EOS,
    even when ignored or masked by ``min_tokens``: a superset) and the total length from
    which every token may end it — its length limit, or 0 when an observer (stop strings)
    reads every token; ``req.observer`` is set before the first token is committed and
    never changes."""
    ids = set(req.params.stop_token_ids)
    if req.eos_token_id is not None:
        ids.add(req.eos_token_id)
    return frozenset(ids), 0 if req.observer is not None else length_limit(req, max_model_len)
