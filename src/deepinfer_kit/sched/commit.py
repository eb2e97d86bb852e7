"""Commit: apply an executed round to the requests (tokens, stops, forks, speculative
rollback), publish committed blocks, retire finished sequences and report them."""

from __future__ import annotations

from deepinfer_kit.errors import InvariantError
from deepinfer_kit.outputs import Logprob, RequestOutput
from deepinfer_kit.request import Request, RequestStatus
from deepinfer_kit.sched.base import SchedulerCore, _will_fork
from deepinfer_kit.sched.forks import spawn_child
from deepinfer_kit.sched.records import ScheduledChunk, SchedulePlan, StepResult
from deepinfer_kit.sched.stops import append_token, append_tokens

__all__ = ["CommitCore"]

_RUNNING = RequestStatus.RUNNING
_FINISHED = RequestStatus.FINISHED


class CommitCore(SchedulerCore):
    """Adds :meth:`commit` (the Scheduler Protocol member) to :class:`SchedulerCore`."""

    def commit(self, plan: SchedulePlan, result: StepResult) -> list[RequestOutput]:
        """Apply one executed round; see :meth:`Scheduler.commit`.

        Per chunk whose request is still running and was not preempted since: appends the
        sampled tokens (a fork chunk creates the ``n - 1`` children), applies the stop
        rules, publishes the full blocks among the committed tokens. Finished sequences
        leave the running list and their blocks are freed (deferred while a later
        in-flight plan includes them). O(chunks) plus O(R) when something finished.

        Raises:
            InvariantError: ``plan`` is not the oldest uncommitted plan, or ``result`` is
                not aligned with its chunks.
        """
        inflight = self._inflight
        while inflight and inflight[0] is not plan and not inflight[0].chunks:
            self._free_deferred(inflight.popleft().step_id)  # an empty plan nobody committed
        if not inflight or inflight[0] is not plan:
            expected = inflight[0].step_id if inflight else None
            raise InvariantError(
                f"plans must be committed in schedule order: got step {plan.step_id}, "
                f"expected {expected}"
            )
        token_ids = result.token_ids
        chunks = plan.chunks
        if len(token_ids) != len(chunks):
            raise InvariantError(
                f"result has {len(token_ids)} token lists for {len(chunks)} chunks"
            )
        inflight.popleft()
        logprobs = result.logprobs
        max_len = self.config.max_model_len
        block_size = self._block_size
        cache = self.cache
        finished: list[Request] = []
        for i, chunk in enumerate(chunks):
            req = chunk.request
            if req.status is not _RUNNING or req.num_preemptions != chunk.preemption_epoch:
                continue  # aborted, finished by an earlier commit, or preempted since
            end = chunk.start + chunk.num_tokens
            if chunk.sample:
                tokens = token_ids[i]
                lps = logprobs[i] if logprobs is not None else None
                if chunk.num_samples > 1:
                    self._commit_fork(chunk, tokens, lps, finished)
                elif chunk.spec_token_ids:
                    end = self._commit_spec(chunk, tokens, lps)
                elif len(tokens) != 1:
                    raise InvariantError(
                        f"chunk {i} ({req.request_id}) expects 1 token, got {tokens!r}"
                    )
                else:
                    append_token(req, tokens[0], lps[0] if lps else None, max_len)
                metrics = req.metrics
                if metrics is not None and metrics.first_token_time is None:
                    metrics.first_token_time = self._clock()
            if end // block_size > chunk.start // block_size:
                cache.cache_full_blocks(req, end)
            if req.status is _FINISHED:
                finished.append(req)
        if finished:
            self._retire(finished)
        self._free_deferred(plan.step_id)
        outputs: list[RequestOutput] = []
        for req in self._unreported:
            outputs.extend(_to_outputs(req))
        for req in finished:
            outputs.extend(_to_outputs(req))
        self._unreported.clear()
        return outputs

    def _retire(self, finished: list[Request]) -> None:
        """Remove sequences finished by this commit from the running list and free them."""
        now = self._clock()
        for req in finished:
            if req.metrics is not None:
                req.metrics.finished_time = now
            self._forget(req)
        self._running = [r for r in self._running if r.status is _RUNNING]
        self._release(finished)

    def _commit_fork(
        self,
        chunk: ScheduledChunk,
        tokens: list[int],
        lps: list[dict[int, Logprob]] | None,
        finished: list[Request],
    ) -> None:
        """The first sample of an ``n > 1`` request: token 0 continues the request as
        completion 0, token ``j`` starts the new child completion ``j``."""
        parent = chunk.request
        if len(tokens) != chunk.num_samples:
            raise InvariantError(
                f"fork of {parent.request_id} expects {chunk.num_samples} tokens, got {tokens!r}"
            )
        max_len = self.config.max_model_len
        computed = chunk.start + chunk.num_tokens
        self._fork_seats -= chunk.num_samples - 1  # the children take their seats now
        for j in range(1, chunk.num_samples):
            child = spawn_child(parent, j, computed)
            self.cache.fork(parent, child)
            self._requests[child.request_id] = child
            self._children.setdefault(parent.request_id, []).append(child)
            self._running.append(child)
            self._may_share.add(child)
            if append_token(child, tokens[j], lps[j] if lps else None, max_len):
                finished.append(child)
        self._may_share.add(parent)
        append_token(parent, tokens[0], lps[0] if lps else None, max_len)

    def _commit_spec(
        self, chunk: ScheduledChunk, tokens: list[int], lps: list[dict[int, Logprob]] | None
    ) -> int:
        """A verified chunk: append the accepted drafts plus the bonus token, roll the KV
        of rejected positions back. Returns the end of the KV that stays valid."""
        req = chunk.request
        num_spec = len(chunk.spec_token_ids)
        if not 1 <= len(tokens) <= 1 + num_spec:
            raise InvariantError(
                f"verified chunk of {req.request_id} with {num_spec} drafts got "
                f"{len(tokens)} tokens"
            )
        appended = append_tokens(req, tokens, lps, self.config.max_model_len)
        valid_end = chunk.start + chunk.num_tokens - num_spec + min(appended, len(tokens) - 1)
        if req.status is _RUNNING:
            req.num_computed_tokens = valid_end
            if valid_end < chunk.start + chunk.num_tokens:
                self.cache.truncate(req, valid_end)
                # The next write lands in a kept block: let allocate check it for CoW.
                self._may_share.add(req)
        return valid_end


def _to_outputs(request: Request) -> list[RequestOutput]:
    """The finished sequence's output; a fork child reports under the user's (parent's)
    id. An ``n > 1`` request ended (aborted, rejected) before it forked reports all
    ``n`` completions, the ones never started empty, so every index gets its reason."""
    out = request.to_output()
    if request.parent_id is not None:
        out.request_id = request.parent_id
        return [out]
    outs = [out]
    if _will_fork(request):
        for j in range(1, request.params.n):
            extra = request.to_output()
            extra.outputs[0].index = j
            outs.append(extra)
    return outs
