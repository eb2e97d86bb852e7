"""SchedulerDriver: a fake step loop that drives any Scheduler through its Protocol with
random or scripted tokens, checking the invariants of every plan against a shadow of
what each sequence was fed and sampled."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from deepinfer_kit.outputs import CompletionOutput, RequestOutput
from deepinfer_kit.request import Request
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sched.forks import child_id
from deepinfer_kit.sched.protocols import Scheduler
from deepinfer_kit.sched.records import ScheduledChunk, SchedulePlan, SchedulerConfig
from deepinfer_kit.step import StepResult
from deepinfer_kit.testing.suite import expect

__all__ = [
    "SchedulerDriver", "TokenSource", "random_tokens", "make_request", "length_limit_of", "check_decode_rows", "EOS",
]

EOS = 0
"""The EOS id of :func:`make_request`; :class:`SchedulerDriver`'s random tokens avoid it."""

TokenSource = Callable[[ScheduledChunk], list[int]]
"""Per sampling chunk, the ``chunk.num_samples`` tokens the fake step "samples"."""


def random_tokens(seed: int, eos_rate: float = 0.0) -> TokenSource:
    """Tokens uniform in ``[1, 100)``, replaced by :data:`EOS` with probability
    ``eos_rate``; reproducible from ``seed``."""
    rng = random.Random(seed)

    def tokens(chunk: ScheduledChunk) -> list[int]:
        return [
            EOS if rng.random() < eos_rate else rng.randrange(1, 100)
            for _ in range(chunk.num_samples)
        ]

    return tokens


def length_limit_of(chunk: ScheduledChunk, max_model_len: int) -> int:
    """:func:`~deepinfer_kit.sched.stops.length_limit` of a sampling chunk's sequence,
    from its sampling row (prompt and ``max_tokens``) alone."""
    assert chunk.sampling is not None
    max_tokens = chunk.sampling.params.max_tokens
    prompt = len(chunk.sampling.prompt_token_ids)
    return max_model_len if max_tokens is None else min(prompt + max_tokens, max_model_len)


def check_decode_rows(plan: SchedulePlan) -> None:
    """The contract of a plan's decode rows (:class:`~deepinfer_kit.sched.records.DecodeRows`):
    every column as long as the others; each row one plain decode — a sampling row that
    reads no history and does not fork, a block table that holds its position, an output
    position at or past 0; the rows' sequences distinct from the records'. Raises
    :class:`ConformanceError` naming the row."""
    rows = plan.decodes
    n = len(rows.request_ids)
    columns: dict[str, list[Any]] = {
        "starts": rows.starts, "token_ids": rows.token_ids, "block_tables": rows.block_tables,
        "preemption_epochs": rows.preemption_epochs, "sampling": rows.sampling,
        "output_positions": rows.output_positions,
    }
    for name, column in columns.items():
        expect(len(column) == n, f"step {plan.step_id}: decodes.{name} has {len(column)} rows, request_ids {n}")
    for i in range(n):
        sid, row = rows.request_ids[i], rows.sampling[i]
        expect(not row.needs_history, f"{sid}: decode row {i} reads its history (must be a record)")
        expect(row.params.n == 1 or "#" in sid or rows.output_positions[i] > 0,
               f"{sid}: decode row {i} is a fork's first sample (must be a record)")
        expect(rows.output_positions[i] >= 0, f"{sid}: decode row {i} at output position {rows.output_positions[i]}")
        expect(rows.starts[i] >= 0, f"{sid}: decode row {i} starts at {rows.starts[i]}")
    records = {c.request_id for c in plan.chunks}
    both = records.intersection(rows.request_ids)
    expect(not both, f"step {plan.step_id}: {sorted(both)} both a decode row and a record")


def make_request(
    request_id: str,
    prompt_len: int,
    *,
    prompt_seed: str | None = None,
    priority: int = 0,
    arrival: float = 0.0,
    **params: object,
) -> Request:
    """A request with a ``prompt_len``-token prompt of ids in ``[1, 1000)`` drawn from
    ``prompt_seed`` (default: the id, so equal seeds give equal prompts), EOS 0, and
    ``SamplingParams(**params)`` (temperature 1 unless given)."""
    params.setdefault("temperature", 1.0)
    rng = random.Random(prompt_seed if prompt_seed is not None else request_id)
    return Request(
        request_id,
        [rng.randrange(1, 1000) for _ in range(prompt_len)],
        SamplingParams(**params),  # type: ignore[arg-type]
        arrival_time=arrival,
        eos_token_id=EOS,
        priority=priority,
    )


class SchedulerDriver:
    """A fake step loop: schedule, "run" with tokens from ``tokens``, commit.

    Checks every plan, from its records alone: ``sum q_i <= B_t`` and
    ``num_batched_tokens`` equals it; at most ``max_num_seqs`` chunks, one per sequence;
    each chunk's token ids, placeholders, drafts and draft room add up to ``num_tokens``
    and its block table covers its positions; no sampling chunk, drafts and draft room
    included, reaches past position ``length_limit - 2`` (the last token is sampled,
    never fed: ``start + num_tokens <= length_limit - 1``); a chunk starts where the sequence's previous chunk
    ended (unless it was preempted or rolled back since); a position, once fed, is always
    fed the same token, and a sampled token that was committed is the one fed at its
    position later (so recomputation after preemption and resumption feed exactly the
    committed history); a sampling chunk reaches past every token known so far.
    Collects every reported completion, keyed ``(request_id, index)``, and fails on a
    completion reported twice or reported unfinished.

    Args:
        sched: the scheduler under test.
        config: the config it was built with.
        block_size: the cache's block size (for the block-table check).
        tokens: per sampling chunk, ``chunk.num_samples`` tokens; default random in
            ``[1, 100)`` from ``seed`` (never EOS).
        model: the whole fake step, plan -> result (e.g. a model that reads its context
            back through the block tables); overrides ``tokens``.
    """

    def __init__(
        self,
        sched: Scheduler,
        config: SchedulerConfig,
        tokens: TokenSource | None = None,
        seed: int = 0,
        model: Callable[[SchedulePlan], StepResult] | None = None,
        block_size: int | None = None,
    ) -> None:
        self.sched = sched
        self.config = config
        self.block_size = block_size
        self.tokens: TokenSource = tokens or random_tokens(seed)
        self.model = model
        self.completions: dict[tuple[str, int], CompletionOutput] = {}
        self.plans: list[SchedulePlan] = []
        self._fed: dict[str, dict[int, int]] = {}  # sequence -> position -> token
        self._next: dict[str, tuple[int, int] | None] = {}  # sequence -> (start, epoch)

    def schedule(self) -> SchedulePlan:
        """``sched.schedule()`` plus the per-plan checks."""
        plan = self.sched.schedule()
        check_decode_rows(plan)
        chunks = plan.all_chunks()
        total = sum(c.num_tokens for c in chunks)
        cfg = self.config
        expect(
            total <= cfg.max_num_batched_tokens, f"round {plan.step_id}: {total} tokens > budget"
        )
        expect(
            plan.num_batched_tokens == total,
            f"num_batched_tokens {plan.num_batched_tokens} != {total}",
        )
        expect(len(chunks) <= cfg.max_num_seqs, f"{len(chunks)} chunks > max_num_seqs")
        ids = [c.request_id for c in chunks]
        expect(len(set(ids)) == len(ids), f"a request scheduled twice in one round: {ids}")
        for c in chunks:
            self._check_chunk(c)
        self.plans.append(plan)
        return plan

    def _check_chunk(self, c: ScheduledChunk) -> None:
        sid = c.request_id
        expect(c.num_tokens >= 1 and c.start >= 0, f"{sid}: empty chunk {c.start}+{c.num_tokens}")
        known = len(c.token_ids) + c.num_placeholders
        expect(
            known + len(c.spec_token_ids) + c.draft_room == c.num_tokens,
            f"{sid}: {len(c.token_ids)} ids + {c.num_placeholders} placeholders + "
            f"{len(c.spec_token_ids)} drafts + {c.draft_room} draft room != {c.num_tokens} tokens",
        )
        expect(c.sample == (c.sampling is not None), f"{sid}: sampling row without a sample")
        if c.sampling is not None:
            limit = length_limit_of(c, self.config.max_model_len)
            expect(
                c.end <= limit - 1,
                f"{sid}: chunk {c.start}+{c.num_tokens} ({len(c.spec_token_ids)} drafts, "
                f"{c.draft_room} draft room) reaches past length_limit - 1 = {limit - 1}",
            )
        if self.block_size is not None:
            expect(
                len(c.block_table) * self.block_size >= c.end,
                f"{sid}: {len(c.block_table)} blocks do not hold positions up to {c.end}",
            )
        nxt = self._next.get(sid)
        if nxt is not None and nxt[1] == c.preemption_epoch:
            expect(c.start == nxt[0], f"{sid}: chunk starts at {c.start}, KV ended at {nxt[0]}")
        fed = self._fed.setdefault(sid, {})
        for pos, tok in enumerate(c.token_ids, c.start):
            was = fed.setdefault(pos, tok)
            expect(was == tok, f"{sid}: position {pos} fed {tok}, earlier {was}")
        if c.sample and fed:
            expect(
                c.start + known >= max(fed) + 1,
                f"{sid}: samples at {c.start + known} before the end of its known tokens",
            )
        drafts = c.spec_token_ids or c.draft_room  # where the next chunk starts: accepted ones
        self._next[sid] = None if drafts else (c.end, c.preemption_epoch)

    def result(self, plan: SchedulePlan) -> StepResult:
        """The fake step's result: ``model(plan)``, or ``[]`` for non-sampling chunks and
        ``tokens(chunk)`` for the others."""
        if self.model is not None:
            return self.model(plan)
        return StepResult([self.tokens(c) if c.sample else [] for c in plan.all_chunks()])

    def commit(self, plan: SchedulePlan, result: StepResult | None = None) -> list[RequestOutput]:
        """``sched.commit`` plus output bookkeeping: sampled tokens that the commit keeps
        become the expected values of their positions."""
        result = result if result is not None else self.result(plan)
        outs = self.sched.commit(plan, result)
        later = {rid for p in self.plans if p.step_id > plan.step_id for rid in p.preempted_ids}
        for c, toks in zip(plan.all_chunks(), result.token_ids):
            if not c.sample or c.spec_token_ids or c.draft_room or not toks or c.request_id in later:
                continue
            pos = c.start + len(c.token_ids) + c.num_placeholders
            for j, tok in enumerate(toks):
                sid = c.request_id if j == 0 else child_id(c.request_id, j)
                self._fed.setdefault(sid, {})[pos] = tok
        for out in outs:
            expect(out.finished, f"{out.request_id} reported before it finished")
            for comp in out.outputs:
                key = (out.request_id, comp.index)
                expect(key not in self.completions, f"completion {key} reported twice")
                expect(
                    comp.finish_reason in ("stop", "length", "abort", "error"),
                    f"{key}: reason {comp.finish_reason}",
                )
                self.completions[key] = comp
                sid = out.request_id if comp.index == 0 else child_id(out.request_id, comp.index)
                self._fed.pop(sid, None)  # the id may be reused by a new request
                self._next.pop(sid, None)
        return outs

    def step(self) -> list[RequestOutput]:
        """One round: schedule, fake-run, commit."""
        return self.commit(self.schedule())

    def run(self, max_rounds: int = 10_000) -> int:
        """Step until nothing is unfinished; returns the rounds taken.

        Raises:
            ConformanceError: still unfinished after ``max_rounds`` (a hang).
        """
        for rounds in range(max_rounds):
            if not self.sched.has_unfinished():
                expect(
                    self.sched.num_unfinished == 0, "num_unfinished != 0 with nothing unfinished"
                )
                return rounds
            self.step()
        expect(
            False,
            f"still unfinished after {max_rounds} rounds "
            f"(num_unfinished={self.sched.num_unfinished})",
        )
        return max_rounds

    def reason(self, request_id: str, index: int = 0) -> str | None:
        """The finish reason reported for a completion (KeyError when not reported)."""
        return self.completions[(request_id, index)].finish_reason
