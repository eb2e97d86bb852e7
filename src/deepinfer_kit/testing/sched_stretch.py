"""Conformance suite for DecodeStretches: a stretch of plain-decode rounds applied in one
call must leave the requests, the KV cache and every later decision exactly as the same
rounds' ``schedule`` / ``commit`` pairs do.

Each check builds two schedulers with your factory, each over its own fresh
prefix-caching cache manager, feeds them the same requests and the same tokens, and advances one with
:meth:`~deepinfer_kit.sched.protocols.DecodeStretches.advance_plain_decodes` where the
other runs round by round.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import attrs

from deepinfer_kit.cache.protocols import KVCacheManager
from deepinfer_kit.errors import InvariantError
from deepinfer_kit.outputs import RequestOutput
from deepinfer_kit.request import Request
from deepinfer_kit.sched.protocols import DecodeStretches, Scheduler
from deepinfer_kit.sched.records import PlainDecodeRun, SchedulerConfig
from deepinfer_kit.step import StepResult
from deepinfer_kit.testing.sched_driver import EOS, make_request
from deepinfer_kit.testing.suite import Suite, expect

__all__ = ["DECODE_STRETCHES_SUITE", "StretchFactory"]

StretchFactory = Callable[
    [SchedulerConfig, int, int, Callable[[], float]], tuple[Scheduler, KVCacheManager]
]
"""``factory(config, num_blocks, block_size, clock)``: a scheduler that also implements
:class:`~deepinfer_kit.sched.protocols.DecodeStretches`, stamping request metrics with
``clock``, over a fresh prefix-caching KV cache manager of that size, and that cache
manager."""

DECODE_STRETCHES_SUITE: Suite[StretchFactory] = Suite(
    "DecodeStretches", "factory(config, num_blocks, block_size, clock) -> (Scheduler, KVCacheManager)"
)

_BLOCK = 4


def _token(request_id: str, position: int, eos_at: dict[str, int]) -> int:
    """The token "sampled" at output ``position`` of ``request_id``: EOS at
    ``eos_at[request_id]``, else a fixed id in ``[1, 50)`` (small, so outputs repeat and
    later prompts share cached blocks with them)."""
    if eos_at.get(request_id) == position:
        return EOS
    return 1 + (sum(map(ord, request_id)) * 7 + position * 13) % 49


@attrs.define
class _Source:
    """A StretchSource asking for ``max_rounds`` rounds of :func:`_token` tokens."""

    max_rounds: int
    eos_at: dict[str, int]
    world: _World | None = None  # whose clock moves by one per round applied
    short: bool = False  # hand out one token too few
    applied_rounds: list[int] = attrs.field(factory=list)

    def rounds(self, run: PlainDecodeRun) -> int:
        return self.max_rounds

    def tokens(self, request_id: str, first: int, count: int) -> list[int]:
        return [_token(request_id, first + r, self.eos_at) for r in range(count - self.short)]

    def applied(self, rounds: int) -> None:
        self.applied_rounds.append(rounds)
        if self.world is not None:
            self.world.now += rounds


@attrs.define
class _World:
    """One scheduler, its cache, its requests by id and the outputs it reported."""

    sched: Scheduler
    cache: KVCacheManager
    eos_at: dict[str, int]
    requests: dict[str, Request] = attrs.field(factory=dict)
    outputs: dict[str, tuple[list[int], str | None, int, object]] = attrs.field(factory=dict)
    frees: list[int] = attrs.field(factory=list)
    last_step: int = -1
    now: float = 0.0  # the scheduler's clock: one second per round

    def clock(self) -> float:
        return self.now

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.sched.add(request)

    def round(self) -> None:
        """One schedule / commit pair; logs ``num_free_blocks`` after the schedule."""
        plan = self.sched.schedule()
        self.last_step = plan.step_id
        self.frees.append(self.cache.num_free_blocks)
        tokens = [
            [_token(c.request_id, c.output_position, self.eos_at)] if c.sample else []
            for c in plan.all_chunks()
        ]
        self.now += 1.0
        self._record(self.sched.commit(plan, StepResult(token_ids=tokens)))

    def _record(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            comp, m = out.outputs[0], out.metrics
            times = (m.first_token_time, m.finished_time) if m is not None else None
            self.outputs[out.request_id] = (list(comp.token_ids), comp.finish_reason,
                                            out.num_cached_tokens, times)

    def stretches(self) -> DecodeStretches:
        sched = self.sched
        expect(isinstance(sched, DecodeStretches),
               f"{type(sched).__name__} does not implement DecodeStretches")
        assert isinstance(sched, DecodeStretches)
        return sched

    def advance(self, max_rounds: int) -> list[int]:
        """``advance_plain_decodes`` asking for ``max_rounds`` rounds."""
        stretch = self.stretches()
        expect(stretch.plain_decode_run() is not None,
               "expected a plain-decode run (every request decoding)")
        source = _Source(max_rounds, self.eos_at, self)
        result = stretch.advance_plain_decodes(source)
        frees = result.frees
        expect(source.applied_rounds == ([len(frees)] if frees else []),
               f"source.applied called with {source.applied_rounds} for {len(frees)} rounds")
        self.frees.extend(frees)
        self.last_step += len(frees)  # each round applied takes a step id
        self._record(result.outputs)
        return frees

    def rounds(self, n: int) -> None:
        """``n`` schedule / commit pairs."""
        for _ in range(n):
            self.round()

    def drain(self) -> None:
        while self.sched.has_unfinished():
            self.round()


def _pair(factory: StretchFactory, num_blocks: int, eos_at: dict[str, int],
          **cfg: object) -> tuple[_World, _World]:
    """Two identical worlds (prefix caching on, block size 4)."""
    config = SchedulerConfig(**cfg)  # type: ignore[arg-type]
    worlds = []
    for _ in range(2):
        world = _World(None, None, eos_at)  # type: ignore[arg-type]  # filled below
        world.sched, world.cache = factory(config, num_blocks, _BLOCK, world.clock)
        worlds.append(world)
    return worlds[0], worlds[1]


def _admit(a: _World, b: _World, specs: list[tuple[str, int, int, str]]) -> None:
    """The same requests ``(id, prompt length, max_tokens, prompt seed)`` into both."""
    for rid, prompt, max_tokens, seed in specs:
        for w in (a, b):
            w.add(make_request(rid, prompt, prompt_seed=seed, max_tokens=max_tokens))


def _until_plain(a: _World, b: _World, limit: int = 50) -> None:
    """Run both round by round until ``a`` offers a plain-decode run."""
    for _ in range(limit):
        if a.stretches().plain_decode_run() is not None:
            return
        a.round()
        b.round()
    expect(False, f"no plain-decode run within {limit} rounds")


def _decoding(factory: StretchFactory, num_blocks: int, specs: list[tuple[str, int, int, str]],
              eos_at: dict[str, int] | None = None) -> tuple[_World, _World]:
    """Two worlds given the requests ``specs``, run until every request decodes."""
    a, b = _pair(factory, num_blocks, eos_at or {})
    _admit(a, b, specs)
    _until_plain(a, b)
    return a, b


def _expect_same(a: _World, b: _World, where: str) -> None:
    """Requests, cache (free blocks, and the prefix it holds of every request's tokens)
    and logs of the two worlds equal."""
    expect(a.frees == b.frees, f"{where}: num_free_blocks per round {a.frees} != {b.frees}")
    expect(a.last_step == b.last_step, f"{where}: last step id {a.last_step}, round by round {b.last_step}")
    for rid, ra in a.requests.items():
        rb = b.requests[rid]
        got = (ra.all_token_ids, ra.num_computed_tokens, ra.block_table, ra.status)
        want = (rb.all_token_ids, rb.num_computed_tokens, rb.block_table, rb.status)
        expect(got == want, f"{where}: request {rid} is {got}, round by round {want}")
        probe = [Request(f"probe-{rid}", list(r.all_token_ids) + [1], ra.params) for r in (ra, rb)]
        hits = (a.cache.match_prefix(probe[0]), b.cache.match_prefix(probe[1]))
        expect(hits[0] == hits[1], f"{where}: {hits[0]} tokens of {rid} cached, round by round {hits[1]}")
    expect(a.cache.num_free_blocks == b.cache.num_free_blocks,
           f"{where}: {a.cache.num_free_blocks} free blocks, round by round {b.cache.num_free_blocks}")
    expect(a.outputs == b.outputs, f"{where}: outputs differ: {a.outputs} vs {b.outputs}")


def _drain_both(a: _World, b: _World, where: str) -> None:
    """Both worlds round by round until nothing is left, then compared."""
    a.drain()
    b.drain()
    _expect_same(a, b, where)


@DECODE_STRETCHES_SUITE.check
def check_a_stretch_equals_its_rounds(factory: StretchFactory) -> None:
    """Block boundaries inside the stretch (allocations and publishes), then a second
    wave that hits and evicts what both published: identical throughout."""
    rng = random.Random(3)
    a, b = _decoding(factory, 48, [(f"r{i}", rng.randrange(3, 11), 40, f"p{i % 2}") for i in range(4)])
    frees = a.advance(23)
    expect(len(frees) == 23, f"expected 23 rounds applied, got {len(frees)}")
    b.rounds(23)
    _expect_same(a, b, "after the stretch")
    _drain_both(a, b, "after the first wave")
    _admit(a, b, [(f"s{i}", rng.randrange(8, 30), 12, f"p{i % 3}") for i in range(6)])
    _drain_both(a, b, "after a second wave sharing and evicting their blocks")


@DECODE_STRETCHES_SUITE.check
def check_ends_with_the_round_of_a_token_that_may_end(factory: StretchFactory) -> None:
    """The stretch runs through the round that samples an EOS, whose commit finishes
    the request (reported with the stretch, finish time at that round's end), and no
    further; the rest decide as round by round."""
    a, b = _decoding(factory, 64, [("r0", 5, 30, "x"), ("r1", 6, 30, "y")], {"r1": 9})
    run = a.stretches().plain_decode_run()
    assert run is not None
    eos_round = 9 - run.output_positions[run.request_ids.index("r1")]
    frees = a.advance(20)
    expect(len(frees) == eos_round + 1,
           f"EOS sampled in round {eos_round} of the stretch: {len(frees)} rounds applied")
    b.rounds(eos_round + 1)
    expect(a.outputs.get("r1", ([], None, 0, None))[1] == "stop",
           f"r1 must stop on EOS in the stretch's last round: {a.outputs}")
    _expect_same(a, b, "after the EOS")
    _drain_both(a, b, "after the rest")


@DECODE_STRETCHES_SUITE.check
def check_ends_with_the_round_that_reaches_the_length_limit(factory: StretchFactory) -> None:
    a, b = _decoding(factory, 64, [("r0", 5, 7, "x"), ("r1", 3, 30, "y")])
    run = a.stretches().plain_decode_run()
    assert run is not None
    left = 7 - run.output_positions[run.request_ids.index("r0")]  # outputs r0 may still sample
    expect(run.max_rounds == left - 1,
           f"max_rounds {run.max_rounds}: r0 may sample {left} more, the last ends it")
    frees = a.advance(30)
    expect(len(frees) == left, f"{len(frees)} rounds applied, expected {left}")
    b.rounds(left)
    expect(len(a.outputs["r0"][0]) == 7 and a.outputs["r0"][1] == "length",
           f"r0 must end by length with 7 tokens in the stretch: {a.outputs.get('r0')}")
    _expect_same(a, b, "at the length limit")
    _drain_both(a, b, "after the rest")


@DECODE_STRETCHES_SUITE.check
def check_stops_before_blocks_run_short(factory: StretchFactory) -> None:
    """A pool that cannot hold both: the stretch ends before the round that would
    preempt, and the rounds after it decide as round by round."""
    a, b = _decoding(factory, 14, [("r0", 6, 40, "x"), ("r1", 6, 40, "y")])
    frees = a.advance(40)
    expect(0 < len(frees) < 40, f"a 14-block pool cannot grow two 46-token requests 40 rounds: {len(frees)}")
    b.rounds(len(frees))
    _expect_same(a, b, "at the shortage")
    _drain_both(a, b, "after the preemption")


@DECODE_STRETCHES_SUITE.check
def check_no_run_while_anything_else_is_planned(factory: StretchFactory) -> None:
    a, b = _pair(factory, 64, {}, max_num_seqs=1)
    _admit(a, b, [("r0", 5, 30, "x")])
    expect(a.stretches().plain_decode_run() is None, "a waiting request is not a plain-decode run")
    a.round()
    _admit(a, b, [("r1", 5, 30, "y")])  # no seat: it waits
    expect(a.stretches().plain_decode_run() is None,
           "a run while a request waits (its admission is the scheduler's to decide)")
    b.round()
    before = a.frees[:]
    expect(a.stretches().advance_plain_decodes(_Source(4, {})).frees == [],
           "advance_plain_decodes without a plain-decode run must apply nothing")
    a.round()
    b.round()
    expect(a.frees[len(before):] == b.frees[len(before):], "an empty stretch changed the next round")
    _expect_same(a, b, "after an empty stretch")


@DECODE_STRETCHES_SUITE.check
def check_a_source_decides_how_many_rounds(factory: StretchFactory) -> None:
    a, b = _decoding(factory, 64, [("r0", 5, 30, "x"), ("r1", 7, 30, "y")])
    expect(a.stretches().advance_plain_decodes(_Source(0, {})).frees == [],
           "a source asking for no round must get none")
    try:
        a.stretches().advance_plain_decodes(_Source(5, {}, short=True))
    except InvariantError:
        pass
    else:
        expect(False, "a token list shorter than the rounds asked for must raise InvariantError")
    _expect_same(a, b, "after the refused stretches")
    expect(len(a.advance(3)) == 3, "a source asking for 3 rounds of a long run must get 3")
    b.rounds(3)
    _expect_same(a, b, "after 3 rounds")


@DECODE_STRETCHES_SUITE.check
def check_no_run_for_rows_the_fast_path_leaves(factory: StretchFactory) -> None:
    """A request whose sampling reads its history (penalties, ``min_tokens``) or that
    wants prompt logprobs never joins a run: its chunks carry more than a plain decode."""
    for label, params in (("penalty", {"repetition_penalty": 1.2}), ("min_tokens", {"min_tokens": 3}),
                          ("prompt logprobs", {"prompt_logprobs": 1})):
        a, _ = _pair(factory, 64, {})
        req = make_request("h", 6, max_tokens=30, **params)
        a.add(req)
        for _ in range(6):
            a.round()
            expect(a.stretches().plain_decode_run() is None,
                   f"a request with {label} joined a plain-decode run")


@DECODE_STRETCHES_SUITE.check
def check_a_one_token_last_prefill_chunk_is_not_a_run(factory: StretchFactory) -> None:
    """A prompt whose last chunk is one token looks like a plain decode (its last known
    token not yet fed) before its first sample: no run then, and its first token is
    stamped when it is sampled."""
    a, b = _pair(factory, 64, {}, max_num_batched_tokens=8, max_num_seqs=2)
    _admit(a, b, [("p", 9, 20, "x")])
    a.round()
    b.round()
    req = a.requests["p"]
    expect(req.num_computed_tokens + 1 == len(req.all_token_ids),
           f"setup: one prompt token left, got {req.num_computed_tokens} of {len(req.all_token_ids)}")
    expect(a.stretches().plain_decode_run() is None,
           "a one-token last prefill chunk (no token sampled yet) joined a plain-decode run")
    _until_plain(a, b)
    a.advance(4)
    b.rounds(4)
    _drain_both(a, b, "after the one-token last chunk")
    metrics = req.metrics
    expect(metrics is not None and metrics.first_token_time is not None,
           "the first token of a prompt finished by a one-token chunk was not stamped")
