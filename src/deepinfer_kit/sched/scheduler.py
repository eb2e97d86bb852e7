"""BatchScheduler: the Scheduler — one state record, two phases, injected policies.

Reading order of one step, top to bottom in this file: :meth:`BatchScheduler.schedule`
plans the running set (:func:`~deepinfer_kit.sched.planning.plan_running`), then lets
the batching policy admit waiting sequences; the engine executes the plan;
:meth:`BatchScheduler.commit` applies the result
(:func:`~deepinfer_kit.sched.commit.commit_round`). Continuous and static batching are
two configurations of this class (:func:`~deepinfer_kit.sched.continuous.ContinuousBatchScheduler`,
:func:`~deepinfer_kit.sched.static.StaticBatchScheduler`), not two subclasses.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from deepinfer_kit.cache.protocols import KVCacheManager, wrapped_member
from deepinfer_kit._validators import require_ints_at_least
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.outputs import RequestOutput
from deepinfer_kit.request import FinishReason, Request, RequestStatus
from deepinfer_kit.sched.batching import common_never_fits
from deepinfer_kit.sched.commit import commit_round, oldest_inflight
from deepinfer_kit.sched.planning import plan_running
from deepinfer_kit.sched.policies import default_policies
from deepinfer_kit.sched.protocols import AdmissionPolicy, BatchingPolicy, PreemptionPolicy
from deepinfer_kit.sched.queues import make_waiting_queue
from deepinfer_kit.sched.records import PlainDecodeRun, SchedulePlan, SchedulerConfig, StretchResult
from deepinfer_kit.sched.state import InflightPlan, SchedulerState
from deepinfer_kit.sched.stretch import advance_plain_decodes, plain_decode_run
from deepinfer_kit.step import StepResult

if TYPE_CHECKING:
    from deepinfer_kit.cache.tiers.records import TransferOutput, TransferPlan
    from deepinfer_kit.sched.protocols import DecodeStretches, Scheduler, StretchSource

__all__ = ["BatchScheduler"]

_RUNNING = RequestStatus.RUNNING


class BatchScheduler:
    """Plans rounds within a token budget and ``max_num_seqs``; commits their results.

    Args:
        config: the round limits.
        cache: the KV cache manager (injected; the scheduler never builds one).
        batching: when waiting sequences are admitted and whether blocks running out
            preempts (:class:`~deepinfer_kit.sched.batching.ContinuousBatching` or
            :class:`~deepinfer_kit.sched.batching.StaticBatching`).
        admission: waiting-queue order; ``None`` takes the one ``config.policy`` names
            (FCFS: a deque in arrival order; priority: lower ``priority`` first).
        victim: preemption-victim rule; ``None`` takes the one ``config.policy`` names
            (FCFS: latest arrival; priority: largest ``priority`` value). Never called
            by a non-preemptive batching policy.
        clock: ``time.monotonic``-like clock for the request metrics.

    Overlap: ``schedule()`` may be called again before the previous plan is committed.
    A sequence whose token is still being sampled is scheduled as a decode with
    ``num_placeholders=1``; a chunk whose sequence finished, was aborted or was preempted
    before its commit is ignored by that commit; blocks of finished and aborted
    sequences are freed only after the newest plan in flight that reads them commits.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        cache: KVCacheManager,
        batching: BatchingPolicy,
        *,
        admission: AdmissionPolicy | None = None,
        victim: PreemptionPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        default_admission, default_victim = default_policies(config.policy)
        self.config = config
        self.cache = cache
        self.batching = batching
        self.victim: PreemptionPolicy = victim if victim is not None else default_victim
        order = admission if admission is not None else default_admission
        self.state = SchedulerState(config, cache, make_waiting_queue(order), clock)
        # A cache with sliding-window groups hands each plan the block mappings it set.
        self._drain_table_updates: Callable[[], list[tuple[int, int, int]]] | None = getattr(
            cache, "drain_table_updates", None)
        # A cache over KV tiers (or wrapping one): told of arrivals (prefetch), hands each
        # plan its copies and hears what the device side did (cache/tiers/manager.py).
        self._on_arrival: Callable[[Request], None] | None = wrapped_member(cache, "on_arrival")
        self._drain_kv: Callable[[int], TransferPlan] | None = wrapped_member(cache, "drain_kv_transfers")
        self._finish_kv: Callable[[int, TransferOutput | None], None] | None = wrapped_member(
            cache, "finish_kv_transfers")

    # ---------------------------------------------------------------- the round

    def schedule(self) -> SchedulePlan:
        """Plan one round; see :meth:`Scheduler.schedule`.

        1. every running sequence, in admission order, gets its next chunk (a decode
           token, or the next piece of its prefill); when blocks run out a preemptive
           policy frees victims, which requeue and recompute later;
        2. the batching policy admits waiting sequences with their first chunks.

        Mutates the queues, the requests' ``num_computed_tokens``/``status`` and the
        cache's block tables. O(R + admitted) per round, plus O(R) per preemption.

        Raises:
            OutOfBlocksError: a non-preemptive policy's reservation was broken.
        """
        state = self.state
        budget = self.config.max_num_batched_tokens
        unreported = state.unreported
        plan = SchedulePlan(  # positional: this runs once per round
            state.next_step, [], [], [], [r.request_id for r in unreported] if unreported else [],
            0, budget,
        )
        state.next_step += 1
        entry = InflightPlan(plan, [])
        state.inflight.append(entry)
        victim = self.victim if self.batching.preemptive else None
        budget, preempted = plan_running(state, entry, budget, victim)
        budget = self.batching.admit(state, entry, budget, preempted)
        plan.num_batched_tokens = self.config.max_num_batched_tokens - budget
        drain = self._drain_table_updates
        if not plan.is_empty:  # an empty plan never runs: keep them
            if drain is not None:
                plan.table_updates = drain()
            if self._drain_kv is not None:
                transfers = self._drain_kv(plan.step_id)
                plan.kv_transfers = transfers if transfers else None
        return plan

    def commit(self, plan: SchedulePlan, result: StepResult) -> list[RequestOutput]:
        """Apply one executed round; see :meth:`Scheduler.commit`.

        Appends sampled tokens, applies the stop rules, finishes the sequences whose
        chunk ``result.errors`` names (reason ``error``), publishes full blocks, retires
        and frees finished sequences. Returns an output per sequence that finished (or
        was aborted / rejected since the last commit).

        Raises:
            InvariantError: ``plan`` is not the oldest uncommitted plan, or ``result`` is
                not aligned with its chunks; nothing changes then.
        """
        outputs = commit_round(self.state, oldest_inflight(self.state, plan), result)
        if self._finish_kv is not None and not plan.is_empty:
            self._finish_kv(plan.step_id, result.kv_transfers)
        return outputs

    # ---------------------------------------------------------------- requests

    @property
    def num_unfinished(self) -> int:
        """Live sequences (waiting, running, preempted; fork children count one each) plus
        finished ones the next ``commit`` has yet to report."""
        return len(self.state.requests) + len(self.state.unreported)

    def has_unfinished(self) -> bool:
        """True while :attr:`num_unfinished` is not 0 (an abort keeps it True until the
        commit that reports it)."""
        return bool(self.state.requests) or bool(self.state.unreported)

    def never_fits(self, request: Request) -> str | None:
        """See :meth:`Scheduler.never_fits`: the common rules, then the batching policy's."""
        reason = common_never_fits(request, self.state)
        return reason if reason is not None else self.batching.never_fits(request, self.state)

    def add(self, request: Request) -> None:
        """Queue a new request (status WAITING); O(1) for FCFS, O(log W) keyed.

        A request that can never run (:meth:`never_fits`) is finished at once with reason
        ``error`` (``request.error`` names the limit) and reported by the next ``commit``.

        Raises:
            ConfigError: the id is already live (itself or its fork children), or the
                request is not a fresh WAITING one.
        """
        state = self.state
        rid = request.request_id
        if rid in state.requests or rid in state.children:
            raise ConfigError(f"request_id {rid!r} is already live")
        if request.status is not RequestStatus.WAITING or request.block_table:
            raise ConfigError(
                f"request {rid!r} must be new (status waiting, no blocks), got status "
                f"{request.status.value} with {len(request.block_table)} blocks"
            )
        reason = self.never_fits(request)
        if reason is not None:
            request.error = reason
            state.finish(request, FinishReason.ERROR, reason)
            state.unreported.append(request)
            return
        state.requests[rid] = request
        state.waiting.push(request)
        if self._on_arrival is not None:
            self._on_arrival(request)

    def abort(self, request_id: str) -> bool:
        """Finish ``request_id`` (and its live fork children) with reason ``abort``.

        Works in any state: waiting and preempted sequences leave the queue, running ones
        the running list; blocks are freed now, or at the commit of the newest in-flight
        plan when one may still read them. The id may be reused at once. O(W + R).

        Returns:
            False when no live sequence has this id.
        """
        state = self.state
        targets: list[Request] = []
        req = state.requests.get(request_id)
        if req is not None:
            targets.append(req)
        targets.extend(state.children.get(request_id, ()))
        if not targets:
            return False
        for req in targets:
            if req.status is _RUNNING:
                state.running.remove(req)
                state.drop_fork_seats(req)
            else:
                state.waiting.remove(req)
            state.finish(req, FinishReason.ABORT)
            state.forget(req)
        state.release(targets)
        state.unreported.extend(targets)
        return True

    def reserve_drafts(self, num_draft: int) -> None:
        """Overlapped speculation: from the next ``schedule()`` on, every decode chunk
        reserves budget and blocks for up to ``num_draft`` drafts that the runner proposes
        itself from the sequence's newest tokens (``ScheduledChunk.draft_room``); a decode
        planned while its sequence's previous round is in flight carries that round's
        draft room as ``pending_drafts``. ``0`` turns it off.

        Raises:
            ConfigError: ``num_draft < 0``.
        """
        require_ints_at_least(0, num_draft=num_draft)
        self.state.draft_room = num_draft

    def plain_decode_run(self) -> PlainDecodeRun | None:
        """See :meth:`DecodeStretches.plain_decode_run`: the running set, as columns,
        when the next round plans one plain decode for each running sequence and nothing
        else (:func:`~deepinfer_kit.sched.stretch.plain_decode_run`); ``None`` otherwise.
        O(running)."""
        return plain_decode_run(self.state, self.batching)

    def advance_plain_decodes(self, source: StretchSource) -> StretchResult:
        """See :meth:`DecodeStretches.advance_plain_decodes`: apply up to
        ``source.rounds(run)`` plain-decode rounds of :meth:`plain_decode_run`, sampling
        ``source.tokens``, through the first round in which a token may end a sequence
        (its stop rules applied and finished sequences retired, as its commit would) and
        before a round whose blocks run short; returns the free blocks after each round's
        planning and the last round's outputs.

        Raises:
            InvariantError: a token list shorter than the rounds asked for.
        """
        return advance_plain_decodes(self.state, self.batching, source)

    # ---------------------------------------------------------------- introspection

    @property
    def num_running(self) -> int:
        """Sequences holding (or, in a static batch, reserved for) blocks."""
        return len(self.state.running)

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for admission (new or preempted)."""
        return len(self.state.waiting)

    @property
    def running(self) -> tuple[Request, ...]:
        """The running sequences in scheduling order (a snapshot)."""
        return tuple(self.state.running)

    @property
    def waiting(self) -> tuple[Request, ...]:
        """The waiting sequences in admission order (a snapshot)."""
        return tuple(self.state.waiting)

    def get(self, request_id: str) -> Request | None:
        """The live sequence with this id (a fork child's is ``"{parent}#{index}"``), or
        ``None``. Read-only use: the scheduler owns its state."""
        return self.state.requests.get(request_id)


if TYPE_CHECKING:
    _check: type[Scheduler] = BatchScheduler
    _stretches: type[DecodeStretches] = BatchScheduler
