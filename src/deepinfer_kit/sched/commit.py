"""Phase two of a step: apply an executed round to its sequences — tokens, stops, forks,
speculative rollback, per-row errors — publish committed blocks, retire finished
sequences and report them."""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer_kit.errors import InvariantError
from deepinfer_kit.outputs import Logprob, RequestOutput
from deepinfer_kit.request import FinishReason, Request, RequestStatus
from deepinfer_kit.sched.decodes import commit_decodes
from deepinfer_kit.sched.forks import spawn_child, will_fork
from deepinfer_kit.sched.records import ScheduledChunk, SchedulePlan
from deepinfer_kit.sched.state import InflightPlan, SchedulerState
from deepinfer_kit.sched.stops import append_token, append_tokens, check_stop
from deepinfer_kit.step import StepResult

__all__ = ["oldest_inflight", "commit_round", "report", "to_outputs"]

_RUNNING = RequestStatus.RUNNING
_FINISHED = RequestStatus.FINISHED


def oldest_inflight(state: SchedulerState, plan: SchedulePlan) -> InflightPlan:
    """The in-flight entry of ``plan``, which must be the oldest uncommitted plan.

    Empty plans nobody committed ahead of it are dropped first (their deferred frees
    done); ``plan`` itself stays in flight until :func:`commit_round`.

    Raises:
        InvariantError: ``plan`` is not the oldest uncommitted plan; nothing changes.
    """
    inflight = state.inflight
    while inflight and inflight[0].plan is not plan and inflight[0].plan.is_empty:
        state.free_deferred(inflight.popleft().plan.step_id)
    if not inflight or inflight[0].plan is not plan:
        expected = inflight[0].plan.step_id if inflight else None
        raise InvariantError(
            f"plans must be committed in schedule order: got step {plan.step_id}, "
            f"expected {expected}"
        )
    return inflight[0]


def commit_round(state: SchedulerState, entry: InflightPlan, result: StepResult) -> list[RequestOutput]:
    """Apply one executed round; see :meth:`Scheduler.commit`. ``entry`` is the oldest
    in-flight plan (:func:`oldest_inflight`); it leaves the in-flight queue here.

    Per chunk whose sequence is still running and was not preempted since: appends the
    sampled tokens (a fork chunk creates the ``n - 1`` children) or, when
    ``result.errors`` names the chunk, finishes the sequence with reason ``error``;
    applies the stop rules; publishes the full blocks among the committed tokens.
    Finished sequences leave the running list and their blocks are freed (deferred
    while a later in-flight plan includes them). O(chunks) plus O(R) when something
    finished.

    Raises:
        InvariantError: ``result`` is not aligned with the plan's chunks (checked before
            anything changes).
    """
    plan = entry.plan
    records = plan.chunks
    rows = len(plan.decodes)
    _check_aligned(result, rows + len(records))
    state.inflight.popleft()
    finished: list[Request] = []
    bulk = not (
        result.errors or result.logprobs is not None or result.prompt_logprobs
        or result.num_drafted or entry.shifts
    )
    pos = 0  # records committed so far
    for a, b, at in entry.plain:  # the decode rows, in planning order among the records
        if pos < at:
            _commit_chunks(state, entry, result, records[pos:at], entry.requests[pos:at], rows + pos, finished)
            pos = at
        _commit_rows(state, entry, result, a, b, bulk, finished)
    if pos < len(records):
        _commit_chunks(state, entry, result, records[pos:], entry.requests[pos:], rows + pos, finished)
    return report(state, finished, plan.step_id)


def _commit_rows(state: SchedulerState, entry: InflightPlan, result: StepResult, a: int, b: int,
                 bulk: bool, finished: list[Request]) -> None:
    """Commit decode rows ``[a, b)`` of ``entry``: in bulk (:func:`commit_decodes`) when
    ``bulk`` (nothing in the result needs the general path), a row the bulk loop leaves
    and every row otherwise as its :class:`DecodeChunk` record on the general path."""
    rows, requests = entry.plan.decodes, entry.decode_requests
    if not bulk:
        chunks = [rows.chunk(j) for j in range(a, b)]
        _commit_chunks(state, entry, result, chunks, requests[a:b], a, finished)
        return
    while a < b:
        a = commit_decodes(state, entry, result.token_ids, a, b, finished)
        if a < b:
            _commit_chunks(state, entry, result, [rows.chunk(a)], requests[a : a + 1], a, finished)
            a += 1


def _commit_chunks(state: SchedulerState, entry: InflightPlan, result: StepResult,
                   chunks: Sequence[ScheduledChunk], requests: Sequence[Request], first: int,
                   finished: list[Request]) -> None:
    """The general path of :func:`commit_round` for ``chunks`` of ``entry`` (the records
    of ``requests``), whose results start at index ``first`` of ``result``: every kind of
    chunk, result errors, logprobs and shifts included."""
    token_ids = result.token_ids
    logprobs, errors, prompt_lps = result.logprobs, result.errors, result.prompt_logprobs
    drafted_by_runner = result.num_drafted
    max_len, cache, shifts = state.config.max_model_len, state.cache, entry.shifts
    block_size = cache.block_size
    follows = _follows(state) if state.draft_room else None
    i = first - 1
    for chunk, req, tokens in zip(chunks, requests, token_ids[first : first + len(chunks)]):
        i += 1
        if req.status is not _RUNNING or req.num_preemptions != chunk.preemption_epoch:
            continue  # aborted, finished by an earlier commit, or preempted since
        if errors:
            message = errors[i]
            if message is not None:
                req.error = message
                state.finish(req, FinishReason.ERROR, message)
                finished.append(req)
                continue
        start = chunk.start - shifts.get(req, 0) if shifts else chunk.start
        num_tokens = chunk.num_tokens
        room = chunk.draft_room
        num_spec = len(chunk.spec_token_ids)
        if room:  # the runner drafted (up to room) itself: its result says how many
            num_spec = drafted_by_runner[i] if drafted_by_runner else 0
            num_tokens += num_spec - room
        end = start + num_tokens
        if prompt_lps:
            _extend_prompt_logprobs(req, chunk, prompt_lps[i])
        if chunk.sample:
            lps = logprobs[i] if logprobs is not None else None
            if chunk.num_samples > 1:
                _commit_fork(state, req, chunk, tokens, lps, finished)
            elif num_spec or room:
                follow = follows.get(req) if follows else None
                end = _commit_spec(state, req, start, num_tokens, num_spec, tokens, lps, follow)
            elif len(tokens) != 1:
                raise InvariantError(
                    f"chunk {i} ({req.request_id}) expects 1 token, got {tokens!r}"
                )
            elif lps:
                append_token(req, tokens[0], lps[0], max_len)
            else:  # append_token without a logprob, inlined: once per generated token
                token = tokens[0]
                req.all_token_ids.append(token)
                req.output_token_ids.append(token)
                check_stop(req, token, max_len)
            metrics = req.metrics
            if metrics is not None and metrics.first_token_time is None:
                metrics.first_token_time = state.clock()
        if end // block_size > start // block_size:
            cache.cache_full_blocks(req, end)
        if req.status is _FINISHED:
            finished.append(req)


def _check_aligned(result: StepResult, num_chunks: int) -> None:
    """Raise :class:`InvariantError` unless ``result`` has one token list (and, when it
    has errors, one error) per chunk."""
    if len(result.token_ids) != num_chunks or (result.errors and len(result.errors) != num_chunks):
        raise InvariantError(
            f"result has {len(result.token_ids)} token lists and {len(result.errors)} errors for "
            f"{num_chunks} chunks"
        )


def _extend_prompt_logprobs(req: Request, chunk: ScheduledChunk, lps: list[dict[int, Logprob]]) -> None:
    """Append a chunk's prompt logprobs to its request's, when the chunk continues them."""
    done = req.prompt_logprobs
    if done is not None and chunk.prompt_first == len(done) - 1:
        done.extend(lps)


def report(state: SchedulerState, finished: list[Request], step_id: int) -> list[RequestOutput]:
    """Retire this commit's finished sequences (finish time from ``state.clock``, running
    list, blocks), run the frees deferred to ``step_id``, and return the outputs of
    everything finished since the last report. The end of every commit."""
    if finished:
        _retire(state, finished)
    if state.deferred:
        state.free_deferred(step_id)
    outputs: list[RequestOutput] = []
    unreported = state.unreported
    if unreported:
        for req in unreported:
            outputs.extend(to_outputs(req))
        unreported.clear()
    for req in finished:
        outputs.extend(to_outputs(req))
    return outputs


def _retire(state: SchedulerState, finished: list[Request]) -> None:
    """Remove sequences finished by this commit from the running list and free them."""
    now = state.clock()
    for req in finished:
        if req.metrics is not None:
            req.metrics.finished_time = now
        if will_fork(req):
            state.drop_fork_seats(req)  # ended (error) before its first sample forked
        state.forget(req)
    state.running = [r for r in state.running if r.status is _RUNNING]
    state.release(finished)


def _commit_fork(
    state: SchedulerState,
    parent: Request,
    chunk: ScheduledChunk,
    tokens: list[int],
    lps: list[dict[int, Logprob]] | None,
    finished: list[Request],
) -> None:
    """The first sample of an ``n > 1`` request: token 0 continues the request as
    completion 0, token ``j`` starts the new child completion ``j``."""
    if len(tokens) != chunk.num_samples:
        raise InvariantError(
            f"fork of {parent.request_id} expects {chunk.num_samples} tokens, got {tokens!r}"
        )
    max_len = state.config.max_model_len
    computed = chunk.start + chunk.num_tokens
    state.fork_seats -= chunk.num_samples - 1  # the children take their seats now
    for j in range(1, chunk.num_samples):
        child = spawn_child(parent, j, computed)
        state.cache.fork(parent, child)
        state.requests[child.request_id] = child
        state.children.setdefault(parent.request_id, []).append(child)
        state.running.append(child)
        state.may_share.add(child)
        if append_token(child, tokens[j], lps[j] if lps else None, max_len):
            finished.append(child)
    state.may_share.add(parent)
    append_token(parent, tokens[0], lps[0] if lps else None, max_len)


def _follows(state: SchedulerState) -> dict[Request, tuple[InflightPlan, ScheduledChunk]] | None:
    """Overlapped speculation: the sequences whose chunk in the next plan in flight
    continues from this one (a placeholder), with that plan and chunk."""
    if not state.inflight:
        return None
    nxt = state.inflight[0]
    return {req: (nxt, c) for req, c in zip(nxt.requests, nxt.plan.chunks) if c.num_placeholders}


def _commit_spec(
    state: SchedulerState,
    req: Request,
    start: int,
    num_tokens: int,
    num_spec: int,
    tokens: list[int],
    lps: list[dict[int, Logprob]] | None,
    follow: tuple[InflightPlan, ScheduledChunk] | None,
) -> int:
    """A verified chunk (``num_tokens`` from ``start``, its last ``num_spec`` drafts,
    possibly none): append the accepted drafts plus the bonus token, roll the KV of
    rejected positions back. Returns the end of the KV that stays valid.

    With the sequence's next chunk already in flight (``follow``, overlapped speculation),
    that chunk assumed every draft here accepted: it moves down by the drafts rejected
    (recorded for its own commit, the runner moving it the same way), and so does the
    sequence's computed count; the blocks past the moved chunk are released."""
    if not 1 <= len(tokens) <= 1 + num_spec:
        raise InvariantError(
            f"verified chunk of {req.request_id} with {num_spec} drafts got {len(tokens)} tokens"
        )
    if req.metrics is not None:
        req.metrics.num_draft_tokens += num_spec
        req.metrics.num_accepted_tokens += len(tokens) - 1
    appended = append_tokens(req, tokens, lps, state.config.max_model_len)
    valid_end = start + num_tokens - num_spec + min(appended, len(tokens) - 1)
    # A stop inside the accepted run drops what follows; like a plain decode, the KV of
    # the last token (never fed as context) is not published.
    valid_end = min(valid_end, len(req.all_token_ids) - 1)
    if req.status is _RUNNING:
        if follow is None:
            reserved = req.num_computed_tokens
            req.num_computed_tokens = valid_end
        else:
            nxt, chunk = follow
            shift = chunk.shift(len(tokens))
            if shift < 0:
                raise InvariantError(
                    f"{req.request_id}: the chunk in flight assumed {chunk.pending_drafts} drafts, "
                    f"{len(tokens) - 1} were accepted"
                )
            nxt.shifts[req] = shift
            reserved = req.num_computed_tokens
            req.num_computed_tokens -= shift
        if req.num_computed_tokens < reserved:
            state.cache.truncate(req, req.num_computed_tokens)
            state.tables.pop(req, None)
            # The next write lands in a kept block: let allocate check it for CoW.
            state.may_share.add(req)
    return valid_end


def to_outputs(request: Request) -> list[RequestOutput]:
    """The finished sequence's output(s) — the one place ``n > 1`` fans out.

    A fork child reports under the user's (parent's) id. An ``n > 1`` request that ended
    (aborted, rejected, failed) before it forked reports all ``n`` completions, the ones
    never started empty, so every index gets its reason.
    """
    out = request.to_output()
    if request.parent_id is not None:
        out.request_id = request.parent_id
        return [out]
    outs = [out]
    if will_fork(request):
        for j in range(1, request.params.n):
            extra = request.to_output()
            extra.outputs[0].index = j
            outs.append(extra)
    return outs
