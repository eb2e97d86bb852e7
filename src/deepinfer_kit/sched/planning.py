"""Phase one of a step: plan the running set's chunks — sizes, blocks, preemption.

The loop is the hot path of every scheduler: per running sequence and round it does O(1)
work plus the snapshot of its chunk (:func:`~deepinfer_kit.sched.chunks.add_chunk`),
calling into the KV cache manager only when the chunk crosses into a block the sequence
does not hold yet (or it was just forked and may share its last block). Plain decodes
(one known token, no drafts) take a fast path
(:func:`~deepinfer_kit.sched.decodes.plan_decodes`, one loop over each run of them, their
new blocks allocated in one cache call). Preemption scans the running list, but happens
only when blocks run out.
"""

from __future__ import annotations

from deepinfer_kit.errors import InvariantError, OutOfBlocksError
from deepinfer_kit.request import Request, RequestStatus
from deepinfer_kit.sched.chunks import add_chunk
from deepinfer_kit.sched.decodes import plan_decodes
from deepinfer_kit.sched.forks import will_fork
from deepinfer_kit.sched.protocols import PreemptionPolicy
from deepinfer_kit.sched.records import SchedulePlan
from deepinfer_kit.sched.state import InflightPlan, SchedulerState
from deepinfer_kit.sched.stops import length_limit

__all__ = ["plan_running", "plan_decodes", "add_chunk", "yield_seat"]

_PREEMPTED = RequestStatus.PREEMPTED


def plan_running(
    state: SchedulerState, entry: InflightPlan, budget: int, victim: PreemptionPolicy | None
) -> tuple[int, bool]:
    """Append the next chunk of each running sequence, in list order, to ``entry``.

    Per sequence: a decode is 1 token (plus its drafts); a prefill takes what is left of
    the prompt (and recomputed outputs), capped by the long-prefill threshold and the
    remaining budget. A sequence whose token the in-flight step is sampling gets a
    decode with one placeholder, unless that token will finish it. A sequence with no
    blocks yet (a static batch member's first chunk) first matches the prefix cache.

    Args:
        victim: chooses whom to preempt by recompute when blocks run out; ``None`` for a
            scheduler that reserved every block at admission.

    Returns:
        The budget left and whether anything was preempted.

    Raises:
        OutOfBlocksError: blocks ran out and ``victim`` is ``None``.
    """
    i, budget = plan_decodes(state, entry, 0, budget)
    if i >= len(state.running) or budget <= 0:
        return budget, False  # a round of plain decodes only: no setup for the rest
    cfg = state.config
    chunked = cfg.enable_chunked_prefill
    threshold = cfg.long_prefill_token_threshold if chunked else 0
    max_len = cfg.max_model_len
    cache = state.cache
    block_size = cache.block_size
    plan = entry.plan
    running = state.running
    may_share = state.may_share
    preempted = False
    while i < len(running) and budget > 0:
        i, budget = plan_decodes(state, entry, i, budget)
        if i >= len(running) or budget <= 0:
            break
        req = running[i]
        start = req.num_computed_tokens
        table = req.block_table
        num_known = len(req.all_token_ids)
        num_cached = 0
        if not table:
            num_cached = _first_chunk_prefix(state, plan, req, budget)
            if num_cached < 0:
                i += 1  # without chunking, the first chunk waits for a round with room
                continue
            start = state.first_start(req, num_cached)  # < num_cached: a bounded replay
            req.num_computed_tokens = start
        room = 0
        limit = length_limit(req, max_len)
        n, placeholders, pending = _chunk_size(state, start, num_known, budget, threshold, limit)
        if not n:
            i += 1  # waits for the step in flight (see _chunk_size)
            continue
        if state.draft_room:
            room = _draft_room(state, req, start, n, budget, limit, placeholders)
        total = n + room
        if start + total <= num_cached:  # a replay reaches past its hit in one chunk: wait
            req.num_computed_tokens = num_cached
            i += 1
            continue
        grow = start + total - (num_cached if not table else start)  # counted from the hit
        if start + total > len(table) * block_size or (may_share and req in may_share):
            if not cache.can_allocate(req, grow, num_cached):
                if victim is None:
                    raise OutOfBlocksError(
                        f"{req.request_id} needs blocks for {total} tokens that were "
                        f"reserved at admission; {cache.num_free_blocks} free"
                    )
                i, budget = _make_room(state, entry, req, i, budget, total, victim)
                preempted = True
                if req.status is _PREEMPTED:
                    continue
            state.allocate(plan, req, grow, num_cached)
            may_share.discard(req)
        budget -= add_chunk(state, entry, req, start, n, placeholders, num_cached, pending, room)
        i += 1
    return budget, preempted


def _chunk_size(state: SchedulerState, start: int, num_known: int, budget: int, threshold: int,
                limit: int) -> tuple[int, int, int]:
    """``(tokens, placeholders, pending drafts)`` of a sequence's next chunk from ``start``
    with ``num_known`` tokens known: what is left of its prompt (capped by the long-prefill
    ``threshold`` and the ``budget``), or a one-placeholder decode when the step in flight
    samples its next token (``pending``: the drafts that step may still reject; this chunk
    assumes all accepted). ``(0, 0, 0)``: wait for the step in flight — it samples (or may
    sample) the sequence's last token, or near the length limit the room for drafts
    depends on where the chunk really starts (so the drafts are those synchronous planning
    gives)."""
    if start < num_known:
        n = num_known - start
        if n > 1:
            if threshold and n > threshold:
                n = threshold
            if n > budget:
                n = budget
        return n, 0, 0
    pending = start - num_known
    if num_known + 1 >= limit or start >= limit - 1:
        return 0, 0, 0
    if pending and start + 1 + state.draft_room > limit - 1:
        return 0, 0, 0
    return 1, 1, pending


def _first_chunk_prefix(state: SchedulerState, plan: SchedulePlan, req: Request, budget: int) -> int:
    """A sequence with no blocks yet (a static batch member's first chunk): match the
    prefix cache and admit it, returning the tokens served from the cache; ``-1`` (nothing
    done) when chunked prefill is off and the rest of its prompt waits for a round with
    room for it whole."""
    cfg = state.config
    num_cached = state.cache.match_prefix(req)
    prompt_left = len(req.all_token_ids) - num_cached
    if not cfg.enable_chunked_prefill and budget < prompt_left <= cfg.max_num_batched_tokens:
        return -1
    state.mark_admitted(req, num_cached)
    plan.num_cached_tokens += num_cached
    return num_cached


def _draft_room(state: SchedulerState, req: Request, start: int, n: int, budget: int, limit: int,
                placeholders: int) -> int:
    """The room reserved for the runner's drafts on a chunk of ``n`` tokens from ``start``
    (``state.draft_room`` on a decode that is not a fork, cut by the budget left and by
    ``limit - 1``: no draft reaches past the length limit); 0 on anything else."""
    num_known = len(req.all_token_ids)
    if n == 1 and start + 1 >= num_known and (placeholders or not will_fork(req)):
        return max(0, min(state.draft_room, budget - n, limit - 1 - start - n))
    return 0


def _make_room(
    state: SchedulerState,
    entry: InflightPlan,
    req: Request,
    i: int,
    budget: int,
    total: int,
    victim: PreemptionPolicy,
) -> tuple[int, int]:
    """Preempt victims until ``req`` (at ``running[i]``) can take ``total`` tokens, or
    until ``req`` itself is the victim. A victim already scheduled this round has its
    chunk taken out of the plan. Returns the updated ``(i, budget)``."""
    running = state.running
    while True:
        chosen = victim(running)
        try:
            j = running.index(chosen)
        except ValueError:
            raise InvariantError(
                f"preemption policy chose {chosen.request_id!r}, which is not running"
            ) from None
        del running[j]
        if j < i:
            i -= 1
            budget += _unschedule(entry, chosen)
        _preempt(state, chosen, entry)
        if chosen is req or state.cache.can_allocate(req, total):
            return i, budget


def _unschedule(entry: InflightPlan, victim: Request) -> int:
    """Take ``victim``'s decode row or chunk (and the block copies into its blocks) out of
    the plan, keeping the planning order of what stays (``entry.plain``); returns the
    tokens it had taken."""
    plan = entry.plan
    for j, req in enumerate(entry.decode_requests):
        if req is victim:
            plan.decodes.drop(j)
            del entry.decode_requests[j]
            entry.plain[:] = [(a - (a > j), b - (b > j), at) for a, b, at in entry.plain if (a, b) != (j, j + 1)]
            _drop_copies(plan, victim)
            return 1
    for k, req in enumerate(entry.requests):
        if req is victim:
            chunk = plan.chunks.pop(k)
            del entry.requests[k]
            entry.plain[:] = [(a, b, at - (at > k)) for a, b, at in entry.plain]
            _drop_copies(plan, victim)
            return chunk.num_tokens
    return 0


def _drop_copies(plan: SchedulePlan, victim: Request) -> None:
    """Drop the plan's block copies into ``victim``'s blocks (it releases them)."""
    own = set(victim.block_table)
    plan.block_copies[:] = [c for c in plan.block_copies if c[1] not in own]


def yield_seat(state: SchedulerState, entry: InflightPlan, victim: Request) -> int:
    """Preempt running ``victim`` to free its seat (the fairness rule,
    :func:`~deepinfer_kit.sched.policies.fair_share_victim`): out of the running list and
    of this round's plan, blocks released, requeued at the back of the waiting queue so
    the request it yields to is admitted first. Returns the tokens its chunk had taken
    from the round's budget. O(R + chunks)."""
    state.running[:] = [r for r in state.running if r is not victim]
    tokens = _unschedule(entry, victim)
    _preempt(state, victim, entry, front=False)
    return tokens


def _preempt(state: SchedulerState, victim: Request, entry: InflightPlan, front: bool = True) -> None:
    """Release all of ``victim``'s blocks and requeue it to recompute from scratch (its
    outputs so far are kept and re-prefilled); at the queue's front, or its back."""
    state.free(victim)
    state.drop_fork_seats(victim)
    victim.num_computed_tokens = 0
    victim.status = _PREEMPTED
    victim.num_preemptions += 1
    if front:
        state.waiting.push_preempted(victim)
    else:
        state.waiting.push(victim)
    entry.plan.preempted_ids.append(victim.request_id)
