"""ContinuousBatchScheduler: waiting/running queues, a token budget, chunked prefill,
preemption by recompute, prefix-cache-aware admission, forks and abort."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer_kit.sched.planning import RoundPlanner, make_chunk
from deepinfer_kit.sched.records import SchedulePlan

if TYPE_CHECKING:
    from deepinfer_kit.sched.protocols import Scheduler

__all__ = ["ContinuousBatchScheduler"]


class ContinuousBatchScheduler(RoundPlanner):
    """Admits requests as others finish, every round, within a token budget.

    Each round (:meth:`schedule`):

    1. every running request, in admission order, gets its next chunk: a decode token,
       or the next piece of its prefill capped by ``long_prefill_token_threshold`` and the
       budget left. When its blocks run out, the preemption policy picks victims
       (latest arrival, or largest ``priority``) whose blocks are freed; they requeue
       and recompute later (their output so far is kept and re-prefilled);
    2. when nothing was preempted, waiting requests are admitted in the admission
       policy's order while the budget, ``max_num_seqs`` (``n`` seats for a request that
       will fork) and the blocks allow. The prefix cache is matched afresh at every
       attempt, and the request's first chunk starts after the cached tokens. The queue
       head blocks the ones behind it (no overtaking).

    Requests that can never fit are finished with reason ``error`` when added. See
    :class:`~deepinfer_kit.sched.base.SchedulerCore` for the constructor arguments and
    ``abort``, :class:`~deepinfer_kit.sched.commit.CommitCore` for ``commit``.

    Overlap: ``schedule()`` may be called again before the previous plan is committed.
    A request whose token is still being sampled is scheduled as a decode with
    ``num_placeholders=1``; a chunk whose request finished, was aborted or was
    preempted before its commit is ignored by that commit; blocks of finished and
    aborted requests are freed only after the newest plan in flight commits.
    """

    def schedule(self) -> SchedulePlan:
        """Plan one round; see :meth:`Scheduler.schedule`.

        Mutates the queues, the requests' ``num_computed_tokens``/``status`` and the
        cache's block tables. O(R + admitted) per round, plus O(R) per preemption.
        """
        plan = self._new_plan()
        budget, preempted = self._plan_running(plan, self.config.max_num_batched_tokens)
        if not preempted:
            budget = self._admit(plan, budget)
        plan.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return plan

    def _admit(self, plan: SchedulePlan, budget: int) -> int:
        """Admit waiting requests, each with its first chunk; returns the budget left."""
        cfg = self.config
        cache = self.cache
        waiting = self._waiting
        chunked = cfg.enable_chunked_prefill
        threshold = cfg.long_prefill_token_threshold if chunked else 0
        while waiting and budget > 0:
            req = waiting.peek()
            if not self._has_seats(req):
                break
            num_cached = cache.match_prefix(req)
            num_known = req.num_tokens
            n = num_known - num_cached
            if threshold and n > threshold:
                n = threshold
            if n > budget:
                # Without chunking a prompt waits for a round with room; a resumed request
                # longer than any round's budget is recomputed in chunks regardless.
                if not chunked and n <= cfg.max_num_batched_tokens:
                    break
                n = budget
            if not cache.can_allocate(req, n, num_cached):
                break
            waiting.pop()
            copies = cache.allocate(req, n, num_cached)
            if copies:
                plan.block_copies.extend(copies)
            self._mark_admitted(req, num_cached)
            plan.num_cached_tokens += num_cached
            self._enter_running(req)
            plan.chunks.append(make_chunk(req, num_cached, n, None, 0, num_known))
            req.num_computed_tokens = num_cached + n
            budget -= n
        return budget


if TYPE_CHECKING:
    _check: type[Scheduler] = ContinuousBatchScheduler
