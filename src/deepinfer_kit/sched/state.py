"""SchedulerState: everything a scheduler knows between two calls, in one record.

The queues, the running set, the plans in flight, the frees deferred until a plan in
flight commits, and the per-request counters the round needs (fork seats, draft room). The
two phases of a step — :func:`~deepinfer_kit.sched.planning.plan_round` and
:func:`~deepinfer_kit.sched.commit.commit_round` — read and mutate it; the small
bookkeeping methods below are the only other code that does.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

import attrs

from deepinfer_kit.cache.protocols import KVCacheManager
from deepinfer_kit.request import FinishReason, Request, RequestStatus
from deepinfer_kit.sched.forks import will_fork
from deepinfer_kit.sched.protocols import WaitingQueue
from deepinfer_kit.sched.records import SamplingRow, SchedulePlan, SchedulerConfig

__all__ = ["InflightPlan", "SchedulerState"]

_RUNNING = RequestStatus.RUNNING


@attrs.define(slots=True, eq=False)
class InflightPlan:
    """A plan scheduled and not yet committed, with the live sequences of its chunks.

    The plan itself holds snapshots only; ``requests[i]`` is the sequence of
    ``plan.chunks[i]`` and ``decode_requests[j]`` that of decode row ``j``
    (``plan.decodes``), kept here (never in the plan) so a commit finds the very object
    it scheduled even if the id was aborted and reused in between.
    """

    plan: SchedulePlan
    requests: list[Request]
    shifts: dict[Request, int] = attrs.field(factory=dict)
    """Sequences whose chunk here continues from a step that rejected some of its drafts:
    the positions to move that chunk down (set by the commit of that step)."""
    plain: list[tuple[int, int, int]] = attrs.field(factory=list)
    """The planning order of the decode rows: ``(a, b, at)`` says rows ``[a, b)`` of
    ``plan.decodes`` were planned, one after the other, after the first ``at`` records of
    ``plan.chunks`` and before the rest. Every row is in exactly one range; the commit
    walks them to apply the round in the order it was planned (the batch lays the rows
    out first)."""
    decode_requests: list[Request] = attrs.field(factory=list)

    def requests_all(self) -> list[Request]:
        """Every sequence of the plan, decode rows' first (batch order)."""
        return self.decode_requests + self.requests


@attrs.define(slots=True, eq=False)
class SchedulerState:
    """The mutable state of one scheduler.

    Attributes:
        config: the round limits.
        cache: the KV cache manager (injected).
        waiting: new and preempted sequences holding no blocks, in admission order.
        clock: ``time.monotonic``-like clock for the request metrics.
        running: sequences holding (or, in a static batch, reserved for) blocks, in
            scheduling order.
        requests: live sequences by id (fork children included).
        children: parent id -> its live fork children.
        unreported: sequences finished outside a commit (aborted, rejected); the next
            commit reports them.
        inflight: plans scheduled and not yet committed, oldest first.
        deferred: step id -> sequences whose blocks are freed when that step commits.
        may_share: forked or rolled-back sequences whose last block may be shared (the
            next allocation checks it for copy-on-write).
        fork_seats: running seats held for the children of ``n > 1`` requests that have
            not forked yet.
        draft_room: drafts every decode chunk reserves room for, for the runner to propose
            itself (overlapped speculation, :meth:`BatchScheduler.reserve_drafts`); 0 off.
        rows: each live sequence's sampling row, built at its first sample.
        plain_rows: the rows of ``rows`` whose sequence's plain decodes take the fast
            path's own chunk (no history, no fork, no prompt logprobs: fixed per sequence).
        stop_rules: each sequence's ``(stop ids, check_from)`` that the bulk commit
            filters its tokens with (a superset of what ends it: the length limit, or 0
            with an observer; ``check_stop`` decides; see
            :func:`~deepinfer_kit.sched.decodes.stop_rule`).
            A sequence gets its rule once its first token is stamped (its first bulk
            commit stamps it when nothing did before), so a sequence with a rule needs
            no first-token check.
        tables: each running sequence's block-table snapshot, shared by its chunks while
            the table is unchanged: dropped whenever the scheduler lets the cache change
            the table (:meth:`allocate`, :meth:`free`, a rollback) — the cache changes a
            table only in the calls the scheduler makes.
        next_step: the step id of the next plan.
    """

    config: SchedulerConfig
    cache: KVCacheManager
    waiting: WaitingQueue
    clock: Callable[[], float] = time.monotonic
    running: list[Request] = attrs.field(factory=list)
    requests: dict[str, Request] = attrs.field(factory=dict)
    children: dict[str, list[Request]] = attrs.field(factory=dict)
    unreported: list[Request] = attrs.field(factory=list)
    inflight: deque[InflightPlan] = attrs.field(factory=deque)
    deferred: dict[int, list[Request]] = attrs.field(factory=dict)
    may_share: set[Request] = attrs.field(factory=set)
    fork_seats: int = 0
    draft_room: int = 0
    rows: dict[Request, SamplingRow] = attrs.field(factory=dict)
    tables: dict[Request, list[int]] = attrs.field(factory=dict)
    plain_rows: dict[Request, SamplingRow] = attrs.field(factory=dict)
    stop_rules: dict[Request, tuple[frozenset[int], int]] = attrs.field(factory=dict)
    next_step: int = 0

    # ------------------------------------------------------------------------ seats

    def has_seats(self, request: Request) -> bool:
        """True when admitting ``request`` (``n`` seats if it will fork) keeps running
        sequences, counting seats held for children yet to fork, within ``max_num_seqs``."""
        seats = request.params.n if will_fork(request) else 1
        return len(self.running) + self.fork_seats + seats <= self.config.max_num_seqs

    def enter_running(self, request: Request) -> None:
        """Append an admitted sequence to the running list, holding its children's seats."""
        self.running.append(request)
        if will_fork(request):
            self.fork_seats += request.params.n - 1

    def drop_fork_seats(self, request: Request) -> None:
        """Give back the children's seats of a request leaving the running list unforked."""
        if will_fork(request):
            self.fork_seats -= request.params.n - 1

    def first_start(self, request: Request, num_cached: int) -> int:
        """Where an admitted sequence's first chunk starts after a prefix hit of
        ``num_cached`` tokens: the hit, or earlier for a hit a cache with sliding-window
        groups serves by a bounded replay (``HybridKVCacheManager.replay_start``; the
        chunk must then reach past the hit)."""
        replay_start = getattr(self.cache, "replay_start", None)
        return num_cached if replay_start is None or not num_cached else int(replay_start(request, num_cached))

    def mark_admitted(self, request: Request, num_cached: int) -> None:
        """Record an admission that matched ``num_cached`` prefix tokens."""
        request.status = _RUNNING
        request.num_computed_tokens = num_cached
        metrics = request.metrics
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_cached  # users see the first admission's hit
            if metrics is not None and metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = self.clock()

    def allocate(self, plan: SchedulePlan, request: Request, n: int, num_cached: int) -> None:
        """``cache.allocate(request, n, num_cached)``; its block copies join ``plan`` and
        the sequence's block-table snapshot is dropped (the table may have changed).

        Raises:
            OutOfBlocksError, InvariantError: as ``KVCacheManager.allocate``.
        """
        copies = self.cache.allocate(request, n, num_cached)
        if copies:
            plan.block_copies.extend(copies)
        self.tables.pop(request, None)

    # ------------------------------------------------------------------ end of life

    def finish(self, request: Request, reason: FinishReason, stop: int | str | None = None) -> None:
        """Set the finish reason and the finish time (the caller frees the blocks)."""
        request.finish(reason, stop)
        if request.metrics is not None:
            request.metrics.finished_time = self.clock()

    def forget(self, request: Request) -> None:
        """Drop a finished sequence from the id maps so its id can be reused."""
        if self.requests.get(request.request_id) is request:
            del self.requests[request.request_id]
        self.rows.pop(request, None)
        self.tables.pop(request, None)
        self.stop_rules.pop(request, None)
        self.plain_rows.pop(request, None)
        parent_id = request.parent_id
        if parent_id is not None:
            family = self.children.get(parent_id)
            if family is not None and request in family:
                family.remove(request)
                if not family:
                    del self.children[parent_id]

    def release(self, requests: Iterable[Request]) -> None:
        """Free the blocks of finished sequences now, or at the commit of the newest plan
        in flight when a plan in flight still reads them."""
        if not self.inflight:
            for req in requests:
                self.free(req)
            return
        held = {id(r) for entry in self.inflight for r in entry.requests_all()}
        last = self.inflight[-1].plan.step_id
        for req in requests:
            if id(req) in held:
                self.deferred.setdefault(last, []).append(req)
            else:
                self.free(req)

    def free(self, request: Request) -> None:
        """Return all of ``request``'s blocks to the cache manager now."""
        self.cache.free(request)
        self.may_share.discard(request)
        self.tables.pop(request, None)

    def free_deferred(self, step_id: int) -> None:
        """Free the sequences whose release waited for step ``step_id`` to commit."""
        for req in self.deferred.pop(step_id, ()):
            self.free(req)
