"""The two batching policies — when waiting sequences join the running set — and the
rules, common to both, for a request that could never run.

Continuous batching admits every round while the budget, the seats and the blocks allow
and preempts by recompute when blocks run out; static batching forms a batch only when
the previous one drained, reserving each member's whole life of blocks so it never
preempts. Both are plain values a :class:`~deepinfer_kit.sched.scheduler.BatchScheduler`
is configured with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer_kit.request import Request, RequestStatus
from deepinfer_kit.sched.forks import will_fork
from deepinfer_kit.sched.planning import add_chunk, plan_running, yield_seat
from deepinfer_kit.sched.policies import fair_share_victim
from deepinfer_kit.sched.queues import FcfsQueue
from deepinfer_kit.sched.state import InflightPlan, SchedulerState
from deepinfer_kit.sched.stops import length_limit

if TYPE_CHECKING:
    from deepinfer_kit.sched.protocols import BatchingPolicy

__all__ = ["ContinuousBatching", "StaticBatching", "common_never_fits", "kv_blocks_needed"]


def kv_blocks_needed(request: Request, state: SchedulerState) -> int:
    """Blocks one sequence of ``request`` can ever hold: its KV up to the length limit
    (the last token is sampled, never fed)."""
    return -(-(length_limit(request, state.config.max_model_len) - 1) // state.cache.block_size)


def common_never_fits(request: Request, state: SchedulerState) -> str | None:
    """The rules every batching policy shares; see ``Scheduler.never_fits``."""
    cfg = state.config
    num_prompt = request.num_prompt_tokens
    if num_prompt >= cfg.max_model_len:
        return (
            f"prompt of {num_prompt} tokens must be shorter than "
            f"max_model_len={cfg.max_model_len} (it leaves no room for output)"
        )
    if not cfg.enable_chunked_prefill and num_prompt > cfg.max_num_batched_tokens:
        return (
            f"prompt of {num_prompt} tokens exceeds max_num_batched_tokens="
            f"{cfg.max_num_batched_tokens} with enable_chunked_prefill=False"
        )
    if request.params.n > cfg.max_num_seqs:
        return f"n={request.params.n} completions exceed max_num_seqs={cfg.max_num_seqs}"
    need = kv_blocks_needed(request, state)
    if need > state.cache.num_blocks:
        return (
            f"prompt of {num_prompt} tokens plus max_tokens={request.params.max_tokens} "
            f"(up to {length_limit(request, cfg.max_model_len)} tokens) "
            f"needs {need} KV blocks of {state.cache.block_size} tokens, more than "
            f"num_blocks={state.cache.num_blocks}"
        )
    return None


class ContinuousBatching:
    """Admit waiting sequences every round, in admission order, each with its first chunk.

    Admission stops at the first sequence that does not fit (no overtaking): no seat,
    no budget, or no blocks for its first chunk. The prefix cache is matched afresh at
    every attempt and the first chunk starts after the cached tokens. Nothing is
    admitted in a round that preempted. Preemptive.

    Fairness (arrival-order queues): when the first waiting sequence lacks a seat and one
    request's sequences hold more than half of ``max_num_seqs``, that request gives seats
    up (:func:`~deepinfer_kit.sched.policies.fair_share_victim`; the sequences yielding
    them recompute later, from the back of the queue), so an ``n = max_num_seqs``
    request never holds every seat while others wait.
    """

    @property
    def preemptive(self) -> bool:
        """True: blocks running out preempts a victim by recompute."""
        return True

    def never_fits(self, request: Request, state: SchedulerState) -> str | None:
        """No rule beyond the common ones."""
        return None

    def admit(self, state: SchedulerState, entry: InflightPlan, budget: int, preempted: bool) -> int:
        """See :meth:`BatchingPolicy.admit`. O(admitted)."""
        if preempted:
            return budget
        cfg = state.config
        cache = state.cache
        waiting = state.waiting
        plan = entry.plan
        chunked = cfg.enable_chunked_prefill
        threshold = cfg.long_prefill_token_threshold if chunked else 0
        while waiting and budget > 0:
            req = waiting.peek()
            if not state.has_seats(req):
                budget += _make_seats(state, entry, req)
                if not state.has_seats(req):
                    break
            num_cached = cache.match_prefix(req)
            start = state.first_start(req, num_cached)  # < num_cached: a bounded replay
            n = req.num_tokens - start
            if threshold and n > threshold:
                n = threshold
            if n > budget:
                # Without chunking a prompt waits for a round with room; a resumed request
                # longer than any round's budget is recomputed in chunks regardless.
                if not chunked and n <= cfg.max_num_batched_tokens:
                    break
                n = budget
            if start + n <= num_cached:  # a replay reaches past its hit in one chunk: wait
                break
            if not cache.can_allocate(req, start + n - num_cached, num_cached):
                break
            waiting.pop()
            state.allocate(plan, req, start + n - num_cached, num_cached)
            state.mark_admitted(req, num_cached)
            req.num_computed_tokens = start
            plan.num_cached_tokens += num_cached
            state.enter_running(req)
            budget -= add_chunk(state, entry, req, start, n, num_cached=num_cached)
        return budget


def _make_seats(state: SchedulerState, entry: InflightPlan, head: Request) -> int:
    """Apply the fairness rule for ``head`` (an arrival-order queue's first sequence):
    preempt the victims :func:`fair_share_victim` names until ``head`` has its seats, or
    none is named. Returns the budget the victims' chunks gave back."""
    if not isinstance(state.waiting, FcfsQueue):  # a keyed order decides who goes first
        return 0
    cfg = state.config
    need = head.params.n if will_fork(head) else 1
    freed = 0
    while not state.has_seats(head):
        free = cfg.max_num_seqs - len(state.running) - state.fork_seats
        victim = fair_share_victim(state.running, head, need, free, cfg.max_num_seqs)
        if victim is None:
            break
        freed += yield_seat(state, entry, victim)
    return freed


class StaticBatching:
    """Form a new batch only when every member of the current one has stopped.

    Admission reserves each member's whole life of blocks (prompt plus ``max_tokens``,
    times ``n`` for a request that forks), so the batch never runs out of blocks and
    nothing is preempted; blocks are still allocated lazily, one block boundary at a
    time, and a member matches the prefix cache at its first chunk. A stopped member's
    blocks are freed at once but its seat stays empty until the batch drains.
    """

    @property
    def preemptive(self) -> bool:
        """False: the reservation makes a shortfall a broken invariant."""
        return False

    def never_fits(self, request: Request, state: SchedulerState) -> str | None:
        """The whole fork family must fit the pool at once."""
        n = request.params.n
        if n > 1:
            need = n * kv_blocks_needed(request, state)
            if need > state.cache.num_blocks:
                limit = length_limit(request, state.config.max_model_len) - 1
                return (
                    f"n={n} completions of up to {limit} tokens need {need} KV blocks at "
                    f"once, more than num_blocks={state.cache.num_blocks} (static batching "
                    f"reserves them)"
                )
        return None

    def admit(self, state: SchedulerState, entry: InflightPlan, budget: int, preempted: bool) -> int:
        """When the running set is empty, move waiting sequences into it while seats and
        the reservation allow, then plan their first chunks. O(batch)."""
        if state.running:
            return budget
        waiting = state.waiting
        free = state.cache.num_free_blocks
        reserved = 0
        while waiting:
            req = waiting.peek()
            seats = req.params.n if will_fork(req) else 1
            need = seats * kv_blocks_needed(req, state)
            if not state.has_seats(req) or reserved + need > free:
                break
            waiting.pop()
            req.status = RequestStatus.RUNNING
            state.enter_running(req)
            reserved += need
        budget, _ = plan_running(state, entry, budget, None)
        return budget


if TYPE_CHECKING:
    _continuous: type[BatchingPolicy] = ContinuousBatching
    _static: type[BatchingPolicy] = StaticBatching
