"""Stretches of plain-decode rounds, applied at once with the cache calls the rounds'
own schedule / commit pairs would make, in the same order.

When every running sequence is a plain decode (its last known token fed, one token
sampled, no drafts, nothing shared) and nothing else can be planned (no waiting sequence,
nothing in flight or unreported), each round is planned the same way: every sequence feeds
its last token; a sequence whose token opens a new block gets one fresh block (one
:meth:`~deepinfer_kit.cache.protocols.KVCacheManager.allocate_next_blocks` call per round,
in running order); the commit appends each sampled token and publishes the block it
filled. Until the round in which a token may end a sequence (that round included: its
commit applies the stop rules), the blocks run short, or the caller's world changes (a
request arrives), consecutive rounds differ only in their positions. A caller that
knows the sampled tokens ahead (the simulator's synthetic model) applies such a stretch
here in one call: the requests, the cache and the scheduler's counters end as
``rounds`` schedule / commit pairs leave them, with no plan built per round.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat

from deepinfer_kit.errors import InvariantError
from deepinfer_kit.request import Request, RequestStatus
from deepinfer_kit.sched.batching import ContinuousBatching, StaticBatching
from deepinfer_kit.sched.commit import report
from deepinfer_kit.sched.decodes import fast_path_row, stop_rule
from deepinfer_kit.sched.protocols import BatchingPolicy, StretchSource
from deepinfer_kit.sched.records import PlainDecodeRun, StretchResult
from deepinfer_kit.sched.state import SchedulerState
from deepinfer_kit.sched.stops import check_stop

__all__ = ["plain_decode_run", "advance_plain_decodes"]

_RUNNING = RequestStatus.RUNNING
# Batching policies whose admit() plans nothing while the waiting queue is empty.
_IDLE_WITHOUT_WAITING = (ContinuousBatching, StaticBatching)


def plain_decode_run(state: SchedulerState, batching: BatchingPolicy) -> PlainDecodeRun | None:
    """The running set as a :class:`PlainDecodeRun` when the next round would plan one
    plain decode for every running sequence and nothing else; ``None`` otherwise.

    Required: nothing in flight, unreported or deferred; no waiting sequence, no draft
    room, drafts, fork seats or possibly shared block; a batching policy that admits
    nothing from an empty queue; at most ``max_num_batched_tokens`` running sequences,
    each RUNNING with blocks, its last known token not yet fed, a sampling row the fast
    path builds its own chunk for (no history, no fork, no prompt logprobs), no observer
    and its first token already stamped. Mutates only the per-sequence caches the next
    round's planning fills alike (``plain_rows``, ``stop_rules``). O(running); the
    newest sequence (the likeliest not to qualify) is checked first.
    """
    if (
        state.inflight or state.unreported or state.deferred or state.draft_room
        or state.may_share or state.fork_seats or len(state.waiting)
        or not isinstance(batching, _IDLE_WITHOUT_WAITING)
    ):
        return None
    running = state.running
    if not running or len(running) > state.config.max_num_batched_tokens:
        return None
    last = running[-1]
    if last.num_computed_tokens + 1 != len(last.all_token_ids):
        return None  # e.g. admitted last round and still prefilling
    plain_rows, rules = state.plain_rows, state.stop_rules
    max_len = state.config.max_model_len
    ids: list[str] = []
    starts: list[int] = []
    outputs: list[int] = []
    rounds = max_len
    for req in running:
        start = req.num_computed_tokens
        num_known = len(req.all_token_ids)
        if start + 1 != num_known or req.status is not _RUNNING or not req.block_table:
            return None
        rule = rules.get(req)  # held only once the first token is stamped (and rows built)
        if rule is None:
            metrics = req.metrics
            if metrics is not None and metrics.first_token_time is None:
                return None
            rule = rules[req] = stop_rule(req, max_len)
        if req not in plain_rows and fast_path_row(state, req) is None:
            return None
        if req.observer is not None:
            return None
        room = rule[1] - num_known - 1  # appended tokens keep the length under the limit
        if room < rounds:
            rounds = room
        ids.append(req.request_id)
        starts.append(start)
        outputs.append(start + 1 - len(req.prompt_token_ids))
    if rounds < 1:
        return None
    return PlainDecodeRun(ids, starts, outputs, rounds)


def advance_plain_decodes(
    state: SchedulerState, batching: BatchingPolicy, source: StretchSource
) -> StretchResult:
    """Apply up to ``source.rounds(run)`` rounds of the current :func:`plain_decode_run`
    ``run``, where sequence ``i`` (running order) samples ``source.tokens(...)[r]`` in
    round ``r``. Returns the cache's ``num_free_blocks`` after each applied round's
    planning (one entry per round; empty when there is no run or no round was asked for,
    and then nothing changed but the caches :func:`plain_decode_run` fills) and the
    outputs of the sequences the last round finished.

    The stretch runs through the first round in which a sampled token may end a sequence
    (a stop id or EOS, or the length limit): that round's commit applies the stop rules
    to those tokens and retires the sequences they end, after ``source.applied(rounds)``
    has moved the clock to its end. It stops before a round that needs more new blocks
    than the cache has (the general path preempts then), or at the rounds asked for; the
    rounds it leaves are the caller's to schedule as usual. Mutates what those rounds'
    ``schedule`` / ``commit`` pairs would: each sequence's tokens and
    ``num_computed_tokens``, its blocks (the same ``allocate_next_blocks`` and
    ``cache_full_blocks`` calls, in the same order, with the request in the same state),
    the table snapshots, the step counter, and the finished sequences' status, running
    seat and blocks. O(sequences × rounds) token copies plus O(blocks crossed) cache
    calls.

    Raises:
        InvariantError: a token list shorter than the rounds asked for, or the cache gave
            fewer blocks than it reported free.
    """
    run = plain_decode_run(state, batching)
    if run is None:
        return StretchResult([], [])
    rounds = min(source.rounds(run), run.max_rounds + 1)  # the last may end sequences
    if rounds <= 0:
        return StretchResult([], [])
    running = list(state.running)
    rules = state.stop_rules
    tokens: list[Sequence[int]] = []
    for req, rid, pos in zip(running, run.request_ids, run.output_positions):
        toks = source.tokens(rid, pos, rounds)
        if len(toks) < rounds:
            raise InvariantError(f"{rid}: {len(toks)} tokens for a stretch of {rounds} rounds")
        ids = rules[req][0]
        if not ids.isdisjoint(toks if len(toks) == rounds else toks[:rounds]):
            rounds = next(r for r, t in enumerate(toks) if t in ids) + 1  # through its round
        tokens.append(toks)
    frees = _apply(state, running, run.starts, tokens, rounds)
    if not frees:
        return StretchResult([], [])
    source.applied(len(frees))
    return StretchResult(frees, report(state, _stop_checks(state, running, tokens, len(frees)),
                                       state.next_step - 1))


def _stop_checks(state: SchedulerState, running: list[Request], tokens: Sequence[Sequence[int]],
                 rounds: int) -> list[Request]:
    """The commit's stop rules for the tokens of the last applied round (``rounds - 1``)
    that may end their sequences (the bulk commit's filter); returns those finished, in
    running order."""
    rules, max_len = state.stop_rules, state.config.max_model_len
    finished: list[Request] = []
    for req, toks in zip(running, tokens):
        token = toks[rounds - 1]
        ids, check_from = rules[req]
        if (token in ids or len(req.all_token_ids) >= check_from) and check_stop(req, token, max_len):
            finished.append(req)
    return finished


def _apply(state: SchedulerState, running: list[Request], starts: list[int],
           tokens: Sequence[Sequence[int]], rounds: int) -> list[int]:
    """The body of :func:`advance_plain_decodes` for ``rounds`` rounds no token ends."""
    cache = state.cache
    block_size = cache.block_size
    grows: dict[int, list[int]] = {}  # round -> sequences whose token opens a block
    fills: dict[int, list[int]] = {}  # round -> sequences whose token fills a block
    for i, req in enumerate(running):
        r = len(req.block_table) * block_size - starts[i]
        if r < 0:
            raise InvariantError(f"{req.request_id}: position {starts[i]} has no block")
        for r in range(r, rounds, block_size):
            grows.setdefault(r, []).append(i)
        for r in range(-(starts[i] + 1) % block_size, rounds, block_size):
            fills.setdefault(r, []).append(i)
    done = [0] * len(running)  # tokens appended to each sequence so far

    def catch_up(i: int, num_tokens: int, computed: int) -> Request:
        """Sequence ``i`` as the real rounds leave it: ``num_tokens`` of its stretch's
        tokens appended and ``computed`` tokens computed."""
        req = running[i]
        if num_tokens > done[i]:
            new = tokens[i][done[i]:num_tokens]
            req.all_token_ids.extend(new)
            req.output_token_ids.extend(new)
            done[i] = num_tokens
        req.num_computed_tokens = computed
        return req

    free = cache.num_free_blocks
    frees: list[int] = []
    for r in sorted(grows.keys() | fills.keys()):
        if r >= rounds:
            break
        frees.extend(repeat(free, r - len(frees)))
        grow = grows.get(r)
        if grow:  # planning round r: the fed tokens known, the sampled one not yet
            if len(grow) > free:
                rounds = r  # the general path preempts for it
                break
            reqs = [catch_up(i, r, starts[i] + r + 1) for i in grow]
            got = cache.allocate_next_blocks(reqs)
            if got != len(reqs):
                raise InvariantError(f"allocate_next_blocks gave {got} of {len(reqs)} blocks it reported free")
            for req in reqs:
                state.tables.pop(req, None)
            free = cache.num_free_blocks
        frees.append(free)
        for i in fills.get(r, ()):  # committing round r: its token appended
            end = starts[i] + r + 1
            cache.cache_full_blocks(catch_up(i, r + 1, end), end)
            free = cache.num_free_blocks
    frees.extend(repeat(free, rounds - len(frees)))
    for i, req in enumerate(running):  # catch_up(i, rounds, starts[i] + rounds), inlined
        if rounds > done[i]:
            new = tokens[i][done[i]:rounds]
            req.all_token_ids.extend(new)
            req.output_token_ids.extend(new)
        req.num_computed_tokens = starts[i] + rounds
    state.next_step += rounds
    return frees
