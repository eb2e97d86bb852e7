"""StaticBatchScheduler: a fixed batch runs until every member stops, then the next."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer_kit.request import Request, RequestStatus
from deepinfer_kit.sched.planning import RoundPlanner
from deepinfer_kit.sched.records import SchedulePlan

if TYPE_CHECKING:
    from deepinfer_kit.sched.protocols import Scheduler

__all__ = ["StaticBatchScheduler"]


class StaticBatchScheduler(RoundPlanner):
    """Static batching: admit up to ``max_num_seqs`` requests, run them to completion.

    A new batch is formed only when every member of the current one has stopped. Each
    member keeps its identity and stops on its own (EOS, stop ids, ``max_tokens``,
    ``min_tokens``, ``ignore_eos``); a stopped member's blocks are freed at once, but its
    seat stays empty until the batch drains. Admission reserves the blocks of each
    member's whole life (prompt plus ``max_tokens``, times ``n`` for a request that
    forks), so the batch never runs out of blocks and nothing is preempted. Blocks are
    still allocated lazily, one block boundary at a time. Prompts are prefilled within
    the round's token budget (in chunks when ``enable_chunked_prefill``).

    Same constructor as :class:`~deepinfer_kit.sched.base.SchedulerCore`; ``victim`` is
    accepted and never called.
    """

    _preemptive = False

    def schedule(self) -> SchedulePlan:
        """Plan one round; see :meth:`Scheduler.schedule`.

        Forms a new batch when the previous one has drained, then gives every member its
        next chunk. O(batch) per round.

        Raises:
            OutOfBlocksError: the reservation was broken (blocks taken by someone else).
        """
        plan = self._new_plan()
        if not self._running:
            self._form_batch()
        budget, _ = self._plan_running(plan, self.config.max_num_batched_tokens)
        plan.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return plan

    def _form_batch(self) -> None:
        """Move waiting requests into the batch while seats and the block reservation
        allow; they get blocks (and their prefix match) at their first chunk."""
        waiting = self._waiting
        free = self.cache.num_free_blocks
        reserved = 0
        while waiting:
            req = waiting.peek()
            need = self._seats(req) * self._blocks_for(self._kv_limit(req))
            if not self._has_seats(req) or reserved + need > free:
                break
            waiting.pop()
            req.status = RequestStatus.RUNNING
            self._enter_running(req)
            reserved += need

    def _never_fits(self, request: Request) -> str | None:
        """Adds the static rule: the whole fork family must fit the pool at once."""
        reason = super()._never_fits(request)
        if reason is None and request.params.n > 1:
            need = request.params.n * self._blocks_for(self._kv_limit(request))
            if need > self.cache.num_blocks:
                return (
                    f"n={request.params.n} completions of up to {self._kv_limit(request)} "
                    f"tokens need {need} KV blocks at once, more than "
                    f"num_blocks={self.cache.num_blocks} (static batching reserves them)"
                )
        return reason


if TYPE_CHECKING:
    _check: type[Scheduler] = StaticBatchScheduler
