"""One round's plan for the running list: chunk sizes, blocks, preemption by recompute.

The loop is the hot path of every scheduler: per running request and round it does
O(1) work and allocates only the chunk record, calling into the KV cache manager only
when the chunk crosses into a block the request does not hold yet (or the request was
just forked and may share its last block). Preemption scans the running list, but
happens only when blocks run out.
"""

from __future__ import annotations

from deepinfer_kit.errors import InvariantError, OutOfBlocksError
from deepinfer_kit.request import Request, RequestStatus
from deepinfer_kit.sched.base import _will_fork
from deepinfer_kit.sched.commit import CommitCore
from deepinfer_kit.sched.records import ScheduledChunk, SchedulePlan

__all__ = ["RoundPlanner", "make_chunk"]

_PREEMPTED = RequestStatus.PREEMPTED


def make_chunk(
    req: Request, start: int, n: int, spec: list[int] | None, placeholders: int, num_known: int
) -> ScheduledChunk:
    """The chunk feeding ``n`` known tokens of ``req`` from ``start`` (then ``spec``).

    It samples when it reaches the last known token; that sample forks into ``n``
    completions when it is the request's first (and not a placeholder decode).
    """
    sample = start + n >= num_known
    fan_out = req.params.n
    return ScheduledChunk(
        req,
        start,
        n + len(spec) if spec else n,
        sample,
        fan_out if fan_out > 1 and sample and not placeholders and _will_fork(req) else 1,
        spec if spec else [],
        1 if placeholders else 0,
        req.num_preemptions,
    )


class RoundPlanner(CommitCore):
    """Adds the running-list planning loop to :class:`CommitCore`.

    ``_preemptive`` (class default True) says whether blocks running out preempts a
    victim by recompute; a non-preemptive scheduler guarantees the blocks at admission
    and treats a shortfall as a broken invariant.
    """

    _preemptive = True

    def _plan_running(self, plan: SchedulePlan, budget: int) -> tuple[int, bool]:
        """Append the next chunk of each running request, in list order, to ``plan``.

        Per request: a decode is 1 token (plus its drafts); a prefill takes what is left
        of the prompt (and recomputed outputs), capped by the long-prefill threshold and
        the remaining budget. A request whose token the in-flight step is sampling gets a
        decode with one placeholder, unless that token will finish it. A request with
        no blocks yet (a static batch member's first chunk) first matches the prefix
        cache. Advances ``num_computed_tokens`` of each scheduled request.

        Returns:
            The budget left and whether anything was preempted.

        Raises:
            OutOfBlocksError: blocks ran out in a non-preemptive scheduler.
        """
        cfg = self.config
        chunked = cfg.enable_chunked_prefill
        threshold = cfg.long_prefill_token_threshold if chunked else 0
        max_len = cfg.max_model_len
        block_size = self._block_size
        cache = self.cache
        chunks = plan.chunks
        running = self._running
        may_share = self._may_share
        drafts = self._drafts
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            table = req.block_table
            num_known = len(req.all_token_ids)
            num_cached = 0
            if not table:
                num_cached = cache.match_prefix(req)
                prompt_left = num_known - num_cached
                if not chunked and budget < prompt_left <= cfg.max_num_batched_tokens:
                    i += 1  # without chunking, the first chunk waits for a round with room
                    continue
                self._mark_admitted(req, num_cached)
                plan.num_cached_tokens += num_cached
            start = req.num_computed_tokens
            placeholders = 0
            if start < num_known:
                n = num_known - start
                if n > 1:
                    if threshold and n > threshold:
                        n = threshold
                    if n > budget:
                        n = budget
            else:
                placeholders = start - num_known + 1
                if (
                    len(req.output_token_ids) + placeholders >= req.params.max_tokens
                    or num_known + placeholders >= max_len
                ):
                    i += 1  # the step in flight samples its last token
                    continue
                n = 1
            spec = drafts.pop(req, None) if drafts else None
            if spec is not None:
                room = min(budget - n, self._kv_limit(req) - start - n)
                spec = spec[:room] if room > 0 and start + n == num_known else None
            total = n + len(spec) if spec else n
            end = start + total
            if end > len(table) * block_size or (may_share and req in may_share):
                if not cache.can_allocate(req, total, num_cached):
                    if not self._preemptive:
                        raise OutOfBlocksError(
                            f"{req.request_id} needs blocks for {total} tokens that were "
                            f"reserved at admission; {cache.num_free_blocks} free"
                        )
                    i, budget = self._make_room(plan, req, i, budget, total)
                    preempted = True
                    if req.status is _PREEMPTED:
                        continue
                copies = cache.allocate(req, total, num_cached)
                if copies:
                    plan.block_copies.extend(copies)
                may_share.discard(req)
            chunks.append(make_chunk(req, start, n, spec, placeholders, num_known))
            req.num_computed_tokens = end
            budget -= total
            i += 1
        return budget, preempted

    def _make_room(
        self, plan: SchedulePlan, req: Request, i: int, budget: int, total: int
    ) -> tuple[int, int]:
        """Preempt victims until ``req`` (at ``running[i]``) can take ``total`` tokens, or
        until ``req`` itself is the victim. A victim already scheduled this round has its
        chunk taken out of ``plan``. Returns the updated ``(i, budget)``."""
        running = self._running
        while True:
            victim = self._victim(running)
            try:
                j = running.index(victim)
            except ValueError:
                raise InvariantError(
                    f"preemption policy chose {victim.request_id!r}, which is not running"
                ) from None
            del running[j]
            if j < i:
                i -= 1
                budget += self._unschedule(plan, victim)
            self._preempt(victim, plan)
            if victim is req or self.cache.can_allocate(req, total):
                return i, budget

    def _unschedule(self, plan: SchedulePlan, victim: Request) -> int:
        """Take ``victim``'s chunk (and the block copies into its blocks) out of ``plan``;
        returns the chunk's tokens."""
        for k, chunk in enumerate(plan.chunks):
            if chunk.request is victim:
                del plan.chunks[k]
                own = set(victim.block_table)
                plan.block_copies[:] = [c for c in plan.block_copies if c[1] not in own]
                return chunk.num_tokens
        return 0

    def _preempt(self, victim: Request, plan: SchedulePlan) -> None:
        """Release all of ``victim``'s blocks and requeue it to recompute from scratch."""
        self._free(victim)
        self._drop_fork_seats(victim)
        self._drafts.pop(victim, None)
        victim.num_computed_tokens = 0
        victim.status = _PREEMPTED
        victim.num_preemptions += 1
        self._waiting.push_preempted(victim)
        plan.preempted_ids.append(victim.request_id)
