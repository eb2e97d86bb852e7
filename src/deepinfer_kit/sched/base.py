"""Bookkeeping shared by the schedulers: live requests, rejection, abort, frees.

:class:`SchedulerCore` holds every piece of state a scheduler needs: the waiting queue,
the running list, the plans in flight, the requests finished outside a commit (aborted
or rejected) and the frees deferred until an in-flight plan commits.
:class:`~deepinfer_kit.sched.commit.CommitCore` adds ``commit``,
:class:`~deepinfer_kit.sched.planning.RoundPlanner` the running-list loop; the
schedulers implement ``schedule()`` on top.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from deepinfer_kit.cache.protocols import KVCacheManager
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.request import FinishReason, Request, RequestStatus
from deepinfer_kit.sched.policies import default_policies
from deepinfer_kit.sched.protocols import AdmissionPolicy, PreemptionPolicy
from deepinfer_kit.sched.queues import make_waiting_queue
from deepinfer_kit.sched.records import SchedulePlan, SchedulerConfig

__all__ = ["SchedulerCore"]

_RUNNING = RequestStatus.RUNNING


class SchedulerCore:
    """State and the Protocol members every scheduler shares (all but ``schedule`` and
    ``commit``, which :class:`~deepinfer_kit.sched.commit.CommitCore` adds).

    Args:
        config: the round limits.
        cache: the KV cache manager (injected; the scheduler never builds one).
        admission: waiting-queue order; ``None`` takes the one ``config.policy`` names
            (FCFS: a deque in arrival order; priority: lower ``priority`` first).
        victim: preemption-victim rule; ``None`` takes the one ``config.policy`` names
            (FCFS: latest arrival; priority: largest ``priority`` value).
        clock: ``time.monotonic``-like clock for the request metrics.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        cache: KVCacheManager,
        *,
        admission: AdmissionPolicy | None = None,
        victim: PreemptionPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        default_admission, default_victim = default_policies(config.policy)
        self.config = config
        self.cache = cache
        self._block_size = cache.block_size
        self._clock = clock
        self._victim: PreemptionPolicy = victim if victim is not None else default_victim
        self._waiting = make_waiting_queue(
            admission if admission is not None else default_admission
        )
        self._running: list[Request] = []
        self._requests: dict[str, Request] = {}  # live sequences by id (children included)
        self._children: dict[str, list[Request]] = {}  # parent id -> its live fork children
        self._unreported: list[Request] = []  # finished outside commit; next commit reports
        self._inflight: deque[SchedulePlan] = deque()  # scheduled, not yet committed
        self._deferred: dict[int, list[Request]] = {}  # step id -> freed at that commit
        self._may_share: set[Request] = set()  # forked: last block may be shared (CoW)
        self._fork_seats = 0  # seats held for the children of running n > 1 requests
        self._drafts: dict[Request, list[int]] = {}  # speculative tokens for the next round
        self._next_step = 0

    # ---------------------------------------------------------------- Protocol members

    @property
    def num_unfinished(self) -> int:
        """Live sequences (waiting, running, preempted; fork children count one each) plus
        finished ones the next ``commit`` has yet to report."""
        return len(self._requests) + len(self._unreported)

    def has_unfinished(self) -> bool:
        """True while :attr:`num_unfinished` is not 0 (an abort keeps it True until the
        commit that reports it)."""
        return bool(self._requests) or bool(self._unreported)

    def add(self, request: Request) -> None:
        """Queue a new request (status WAITING); O(1) for FCFS, O(log W) keyed.

        A request that can never run is finished at once with reason ``error``
        (``request.error`` names the limit) and reported by the next ``commit``.

        Raises:
            ConfigError: the id is already live (itself or its fork children), or the
                request is not a fresh WAITING one.
        """
        rid = request.request_id
        if rid in self._requests or rid in self._children:
            raise ConfigError(f"request_id {rid!r} is already live")
        if request.status is not RequestStatus.WAITING or request.block_table:
            raise ConfigError(
                f"request {rid!r} must be new (status waiting, no blocks), got status "
                f"{request.status.value} with {len(request.block_table)} blocks"
            )
        reason = self._never_fits(request)
        if reason is not None:
            request.error = reason
            self._finish(request, FinishReason.ERROR, reason)
            self._unreported.append(request)
            return
        self._requests[rid] = request
        self._waiting.push(request)

    def abort(self, request_id: str) -> bool:
        """Finish ``request_id`` (and its live fork children) with reason ``abort``.

        Works in any state: waiting and preempted requests leave the queue, running ones
        the running list; blocks are freed now, or at the commit of the newest in-flight
        plan when one may still read them. The id may be reused at once. O(W + R).

        Returns:
            False when no live sequence has this id.
        """
        targets: list[Request] = []
        req = self._requests.get(request_id)
        if req is not None:
            targets.append(req)
        targets.extend(self._children.get(request_id, ()))
        if not targets:
            return False
        for req in targets:
            if req.status is _RUNNING:
                self._running.remove(req)
                self._drop_fork_seats(req)
            else:
                self._waiting.remove(req)
            self._finish(req, FinishReason.ABORT)
            self._forget(req)
        self._release(targets)
        self._unreported.extend(targets)
        return True

    # ------------------------------------------------------------------ introspection

    @property
    def num_running(self) -> int:
        """Sequences holding (or, in a static batch, reserved for) blocks."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for admission (new or preempted)."""
        return len(self._waiting)

    @property
    def running(self) -> tuple[Request, ...]:
        """The running sequences in scheduling order (a snapshot)."""
        return tuple(self._running)

    @property
    def waiting(self) -> tuple[Request, ...]:
        """The waiting sequences in admission order (a snapshot)."""
        return tuple(self._waiting)

    def set_spec_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Draft tokens for ``request_id``'s next decode chunk (speculative decoding).

        The next ``schedule()`` appends them to the chunk as ``spec_token_ids``, trimmed to
        the round's remaining budget and to the request's length limit; they are dropped
        if the request is not decoding then. Not supported together with overlap.

        Raises:
            ConfigError: ``request_id`` is not a live sequence.
        """
        req = self._requests.get(request_id)
        if req is None:
            raise ConfigError(f"request_id {request_id!r} is not live")
        self._drafts[req] = list(token_ids)

    # ------------------------------------------------------------- for the subclasses

    def _new_plan(self) -> SchedulePlan:
        """An empty plan for the next round, registered as in flight."""
        plan = SchedulePlan(
            step_id=self._next_step,
            token_budget=self.config.max_num_batched_tokens,
            finished=list(self._unreported),
        )
        self._next_step += 1
        self._inflight.append(plan)
        return plan

    def _kv_limit(self, request: Request) -> int:
        """Positions whose KV the request can ever need: its last token has none."""
        params = request.params
        return min(request.num_prompt_tokens + params.max_tokens, self.config.max_model_len) - 1

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self._block_size)

    def _never_fits(self, request: Request) -> str | None:
        """Why ``request`` could never run, or ``None``."""
        cfg = self.config
        num_prompt = request.num_prompt_tokens
        if num_prompt >= cfg.max_model_len:
            return (
                f"prompt of {num_prompt} tokens leaves no room for output under "
                f"max_model_len={cfg.max_model_len}"
            )
        if not cfg.enable_chunked_prefill and num_prompt > cfg.max_num_batched_tokens:
            return (
                f"prompt of {num_prompt} tokens exceeds max_num_batched_tokens="
                f"{cfg.max_num_batched_tokens} with enable_chunked_prefill=False"
            )
        if request.params.n > cfg.max_num_seqs:
            return f"n={request.params.n} completions exceed max_num_seqs={cfg.max_num_seqs}"
        need = self._blocks_for(self._kv_limit(request))
        if need > self.cache.num_blocks:
            return (
                f"prompt of {num_prompt} tokens plus max_tokens={request.params.max_tokens} "
                f"needs {need} KV blocks of {self._block_size} tokens, more than "
                f"num_blocks={self.cache.num_blocks}"
            )
        return None

    @staticmethod
    def _seats(request: Request) -> int:
        """Running slots the request takes once admitted: ``n`` before it forks."""
        return request.params.n if _will_fork(request) else 1

    def _has_seats(self, request: Request) -> bool:
        """True when admitting ``request`` keeps running sequences, counting the seats
        held for children yet to fork, within ``max_num_seqs``."""
        used = len(self._running) + self._fork_seats
        return used + self._seats(request) <= self.config.max_num_seqs

    def _enter_running(self, request: Request) -> None:
        """Append an admitted request to the running list, holding its children's seats."""
        self._running.append(request)
        if _will_fork(request):
            self._fork_seats += request.params.n - 1

    def _drop_fork_seats(self, request: Request) -> None:
        """Give back the children's seats of a request leaving the running list unforked."""
        if _will_fork(request):
            self._fork_seats -= request.params.n - 1

    def _mark_admitted(self, request: Request, num_cached: int) -> None:
        """Record an admission that matched ``num_cached`` prefix tokens."""
        request.status = _RUNNING
        request.num_computed_tokens = num_cached
        metrics = request.metrics
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_cached  # users see the first admission's hit
            if metrics is not None and metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = self._clock()

    # ------------------------------------------------------------------------ internals

    def _finish(
        self, request: Request, reason: FinishReason, stop: int | str | None = None
    ) -> None:
        request.finish(reason, stop)
        if request.metrics is not None:
            request.metrics.finished_time = self._clock()

    def _forget(self, request: Request) -> None:
        """Drop a finished sequence from the id maps so its id can be reused."""
        if self._requests.get(request.request_id) is request:
            del self._requests[request.request_id]
        self._drafts.pop(request, None)
        parent_id = request.parent_id
        if parent_id is not None:
            family = self._children.get(parent_id)
            if family is not None and request in family:
                family.remove(request)
                if not family:
                    del self._children[parent_id]

    def _release(self, requests: Iterable[Request]) -> None:
        """Free the blocks of finished sequences, or defer the free to the commit of the
        newest in-flight plan when some in-flight plan schedules them."""
        if not self._inflight:
            for req in requests:
                self._free(req)
            return
        held = {id(c.request) for p in self._inflight for c in p.chunks}
        last = self._inflight[-1].step_id
        for req in requests:
            if id(req) in held:
                self._deferred.setdefault(last, []).append(req)
            else:
                self._free(req)

    def _free(self, request: Request) -> None:
        self.cache.free(request)
        self._may_share.discard(request)

    def _free_deferred(self, step_id: int) -> None:
        for req in self._deferred.pop(step_id, ()):
            self._free(req)


def _will_fork(request: Request) -> bool:
    """True when the request's next sample starts its ``n`` completions."""
    return request.params.n > 1 and request.parent_id is None and not request.output_token_ids
