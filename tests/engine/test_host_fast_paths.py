"""The host path's shortcuts for a round of plain decodes, each against the general path
it skips: the column-wise layout, the one-row-per-chunk results, the decode slot mapping
and unpadded tables, the packed int64 buffer, the finite-row check, the all-greedy
sampler and the byte tokenizer's ASCII detokenizing. Seeded random cases; no timing."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from deepinfer_kit.engine.detokenizer import IncrementalDetokenizer
from deepinfer_kit.engine.runner.layout import RoundLayout, lay_out, lay_out_chunks
from deepinfer_kit.engine.runner.step_outputs import chunk_results, chunk_results_general, finite_rows
from deepinfer_kit.engine.runner.token_slots import CONTINUED_UNSAMPLED, UNSAMPLED, TokenSlots
from deepinfer_kit.engine.streams import SequenceStream
from deepinfer_kit.models.attention.layout import slots_for, step_slots
from deepinfer_kit.models.packing import append_tables, int64_host
from deepinfer_kit.models.tokenizer import ByteTokenizer
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sample.records import SamplingBatch
from deepinfer_kit.sample.vectorized import VectorizedSampler
from deepinfer_kit.sched.records import SamplingRow, ScheduledChunk, SchedulePlan

SEEDS = range(12)
_LAYOUT_FIELDS = ("input_ids", "positions", "query_lens", "seq_lens", "tables", "logits_rows", "row_counts",
                  "params", "seeds", "out_pos", "prompts", "outputs", "eos", "hole_rows")


def _decode_chunk(rng: random.Random, i: int, *, history: bool) -> ScheduledChunk:
    """A plain decode: one known token, one sampled row."""
    params = SamplingParams(temperature=rng.choice([0.0, 0.7]), seed=rng.choice([None, i]))
    start = rng.randint(1, 90)
    row = SamplingRow(params=params, seed=params.seed, prompt_token_ids=[1, 2, 3],
                      eos_token_id=rng.choice([None, 257]), needs_history=history)
    return ScheduledChunk(
        request_id=f"r{i}", start=start, num_tokens=1, token_ids=[rng.randrange(259)],
        block_table=[rng.randrange(500) for _ in range(start // 16 + 1 + rng.randint(0, 2))],
        sampling=row, output_position=rng.randint(0, 50),
        output_token_ids=tuple(rng.randrange(259) for _ in range(3)) if history else (),
    )


def _plan_of(step_id: int, chunks: Sequence[ScheduledChunk]) -> SchedulePlan:
    """A plan whose plain decodes that read no history are decode rows (columns, laid out
    first), the others records: the form the scheduler's fast path gives."""
    plan = SchedulePlan(step_id=step_id)
    for c in chunks:
        row = c.sampling
        if row is not None and not row.needs_history and c.num_tokens == 1 and len(c.token_ids) == 1:
            plan.decodes.append(c.request_id, c.start, c.token_ids[0], c.block_table, c.preemption_epoch, row,
                                c.output_position)
        else:
            plan.chunks.append(c)
    return plan


def _same_layout(a: RoundLayout, b: RoundLayout) -> None:
    for name in _LAYOUT_FIELDS:
        assert getattr(a, name) == getattr(b, name), name
    assert a.routes.tail() == b.routes.tail()
    assert (a.verified, a.prompt.rows, a.prompt.targets) == (b.verified, b.prompt.rows, b.prompt.targets)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_round_of_plain_decodes_lays_out_as_chunk_by_chunk(seed: int) -> None:
    rng = random.Random(seed)
    chunks = [_decode_chunk(rng, i, history=rng.random() < 0.3) for i in range(rng.randint(1, 40))]
    with_slots = seed % 2 == 0
    slots = [TokenSlots(64, "cpu") if with_slots else None for _ in range(2)]
    plan = _plan_of(3, chunks)
    assert plan.decodes.request_ids and plan.num_chunks == len(chunks)
    fast = lay_out(plan, step_id=3, slots=slots[0], can_verify=False, draft_probs=None)
    general = lay_out_chunks(plan.all_chunks(), 3, slots[1], False, None)
    _same_layout(fast, general)
    if with_slots:  # the same slots leased, in the same order
        assert [slots[0].slot_of(c.request_id) for c in chunks] == [slots[1].slot_of(c.request_id) for c in chunks]


def test_a_chunk_that_is_not_a_plain_decode_takes_the_general_path() -> None:
    rng = random.Random(5)
    chunks = [_decode_chunk(rng, i, history=False) for i in range(4)]
    chunks.append(ScheduledChunk(request_id="p", start=0, num_tokens=3, token_ids=[4, 5, 6], block_table=[7],
                                 sampling=chunks[0].sampling))
    plan = _plan_of(1, chunks)
    assert len(plan.decodes) == 4 and len(plan.chunks) == 1
    out = lay_out(plan, step_id=1, slots=None, can_verify=False, draft_probs=None)
    _same_layout(out, lay_out_chunks(chunks, 1, None, False, None))
    assert out.query_lens == [1, 1, 1, 1, 3]


@pytest.mark.parametrize("seed", SEEDS)
def test_one_sampled_row_per_chunk_gives_the_general_results(seed: int) -> None:
    rng = random.Random(seed)
    chunks = [_decode_chunk(rng, i, history=rng.random() < 0.5) for i in range(rng.randint(1, 30))]
    tokens = [rng.randrange(259) for _ in chunks]
    if seed % 3 == 1:  # a sentinel: the shortcut must step aside, and both agree
        tokens[rng.randrange(len(tokens))] = rng.choice([UNSAMPLED, CONTINUED_UNSAMPLED])
    counts = [1] * len(chunks)
    plan = _plan_of(0, chunks)
    ordered = plan.all_chunks()  # the batch order: decode rows first
    positions = [c.output_position for c in ordered]
    assert chunk_results(plan, tokens, counts, {}, positions, None) == chunk_results_general(
        ordered, tokens, counts, {}, positions, None)
    if seed % 3 == 2:  # a round where some chunk drew no row: the columns' general split
        counts = [0 if c.sampling is not None and c.sampling.needs_history and i % 2 else 1
                  for i, c in enumerate(ordered)]
        drawn = tokens[: sum(counts)]
        assert chunk_results(plan, drawn, counts, {}, positions, None) == chunk_results_general(
            ordered, drawn, counts, {}, positions, None)


@pytest.mark.parametrize("seed", SEEDS)
def test_decode_slots_and_unpadded_tables_equal_the_general_ones(seed: int) -> None:
    rng = random.Random(seed)
    n, size = rng.randint(1, 30), 16
    seq_lens = [rng.randint(1, 200) for _ in range(n)]
    width = max(-(-s // size) for s in seq_lens) + rng.randint(0, 1)
    tables = [rng.sample(range(1000), width) for _ in range(n)]
    expected = [slot for s, t in zip(seq_lens, tables) for slot in slots_for(t, s - 1, s, size)]
    assert step_slots([1] * n, seq_lens, tables, size) == expected
    values: list[int] = []
    append_tables(values, tables, width)
    assert values == [b for t in tables for b in t]
    ragged = [t[: rng.randint(1, width)] for t in tables]
    values = []
    append_tables(values, ragged, width)
    assert values == [b for t in ragged for b in [*t, *[0] * (width - len(t))]]


def test_a_decode_past_its_table_still_raises_the_general_error() -> None:
    from deepinfer_kit.errors import ConfigError

    with pytest.raises(ConfigError):
        step_slots([1, 1], [5, 40], [[3], [4]], 16)


@pytest.mark.parametrize("values", [[], [0], [5, -3, 2**63 - 1, -(2**63)], list(range(-50, 3000, 7))])
def test_int64_host_equals_torch_tensor(values: list[int]) -> None:
    packed = int64_host(values)
    assert packed.dtype == torch.int64 and torch.equal(packed, torch.tensor(values, dtype=torch.int64))
    packed[:1] = 9 if values else packed[:1]  # writable, its own memory


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", SEEDS)
def test_finite_rows_equals_the_elementwise_check(seed: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(24, 37, generator=gen) * 1e4).to(dtype)
    for _ in range(6):
        r, c = torch.randint(0, 24, (2,), generator=gen).tolist()
        logits[r, c % 37] = [float("nan"), float("inf"), -float("inf")][c % 3]
    logits[5, 0] = torch.finfo(dtype).max  # huge finite values stay finite
    logits[5, 1] = -torch.finfo(dtype).max
    finite, clean = finite_rows(logits)
    reference = torch.isfinite(logits).all(dim=-1)
    assert torch.equal(finite, reference)
    assert torch.equal(clean, logits.masked_fill(~reference[:, None], 0.0).to(torch.float32))
    assert clean.dtype == torch.float32


def _batch(params: Sequence[SamplingParams]) -> SamplingBatch:
    n = len(params)
    return SamplingBatch(params=list(params), seeds=[p.seed for p in params], positions=[0] * n,
                         prompt_token_ids=[[1]] * n, output_token_ids=[()] * n, eos_token_ids=[None] * n,
                         generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("seed", SEEDS)
def test_an_all_greedy_batch_draws_what_a_mixed_batch_draws_for_those_rows(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(9, 50, generator=gen)
    logits[2, 7] = logits[2, 30] = logits[2].max() + 1  # a tie: the first index
    sampler = VectorizedSampler(impl="ref")
    greedy = [SamplingParams(temperature=0.0)] * 9
    alone = sampler(logits, _batch(greedy)).token_ids
    mixed = sampler(torch.cat([logits, logits[:1]]), _batch([*greedy, SamplingParams(temperature=1.0, seed=3)]))
    assert torch.equal(alone, mixed.token_ids[:9])
    assert torch.equal(alone, logits.argmax(dim=-1)) and int(alone[2]) == 7


class _Bytes:
    """The byte tokenizer under another type: the detokenizer's general path."""

    def __init__(self) -> None:
        self._inner = ByteTokenizer()

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._inner.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("seed", range(40))
def test_ascii_pushes_of_the_byte_tokenizer_equal_the_general_detokenizer(seed: int, skip: bool) -> None:
    rng = random.Random(seed)
    text = "".join(rng.choice(["a", " ", "é", "€", "😀", "\n", "Z"]) for _ in range(30)).encode()
    tokens = [rng.choice([b, b, rng.randrange(259)]) for b in text]  # invalid bytes and specials too
    if seed % 4 == 0:  # any ids at all: mostly held-back windows
        tokens = [rng.randrange(259) for _ in range(60)]
    prompt = [rng.randrange(259) for _ in range(rng.randint(1, 8))]
    fast = IncrementalDetokenizer(ByteTokenizer(), prompt, skip_special_tokens=skip)
    general = IncrementalDetokenizer(_Bytes(), prompt, skip_special_tokens=skip)  # type: ignore[arg-type]
    for i, token in enumerate(tokens):
        assert fast.push(token) == general.push(token)
        assert fast.text == general.text
        if i == len(tokens) // 2:
            fast, general = fast.copy(), general.copy()
    assert fast.flush() == general.flush()
    assert fast.text == general.text == ByteTokenizer().decode(tokens, skip_special_tokens=skip)


def test_an_ascii_byte_never_changes_the_decode_of_the_bytes_before_it() -> None:
    """The rule the ASCII shortcut rests on, for every byte string of up to two bytes and
    every three-byte string of non-ASCII bytes, followed by each ASCII byte."""
    tok = ByteTokenizer()
    heads = [[a] for a in range(256)] + [[a, b] for a in range(256) for b in range(256)]
    heads += [[a, b, c] for a in range(128, 256, 3) for b in range(128, 256, 5) for c in range(128, 256, 7)]
    for head in heads:
        before = tok.decode(head)
        for t in (0, 65, 127):
            assert tok.decode([*head, t]) == before + chr(t), head


@pytest.mark.parametrize("seed", SEEDS)
def test_an_all_greedy_row_plan_equals_the_general_plan_of_those_rows(seed: int) -> None:
    from deepinfer_kit.sample.plan import plan_rows

    rng = random.Random(seed)
    greedy = [SamplingParams(temperature=rng.choice([0.0, 0.5]), top_k=1) if rng.random() < 0.3
              else SamplingParams(temperature=0.0, top_k=rng.choice([-1, 5, 300]), top_p=rng.choice([1.0, 0.9]),
                                  min_p=rng.choice([0.0, 0.1]))
              for _ in range(rng.randint(1, 20))]
    n = len(greedy)
    alone = plan_rows(_batch(greedy), 259)
    mixed = plan_rows(_batch([*greedy, SamplingParams(temperature=1.0)]), 259)
    assert alone.greedy == mixed.greedy == list(range(n))
    for name in ("inv_t", "top_k", "top_p", "min_p"):
        assert getattr(alone, name) == getattr(mixed, name)[:n], name
    assert (alone.full, alone.nucleus, alone.topk, alone.threshold, alone.sort) == ([], [], {}, [], [])


def test_the_plan_memo_reuses_a_plan_only_for_the_very_same_params() -> None:
    from deepinfer_kit.sample.plan import PlanMemo, plan_rows

    rng = random.Random(3)
    pool = [SamplingParams(temperature=rng.choice([0.0, 0.8]), top_k=rng.choice([-1, 20]),
                           presence_penalty=rng.choice([0.0, 0.0, 0.5]), min_tokens=rng.choice([0, 0, 2]))
            for _ in range(12)]
    memo = PlanMemo()
    rounds = [pool[:6], pool[:6], pool[1:7], [*pool[1:6], SamplingParams(**_fields(pool[6]))], pool[1:7]]
    seen = []
    for params in rounds:
        plan, may_edit = memo.plan(_batch(list(params)), 259)  # a fresh list each round
        fresh = plan_rows(_batch(params), 259)
        for name in ("greedy", "full", "nucleus", "topk", "threshold", "sort", "inv_t", "top_k", "top_p", "min_p"):
            assert getattr(plan, name) == getattr(fresh, name), name
        assert may_edit == any(p.has_penalties or p.min_tokens > 0 for p in params)
        seen.append(plan)
    assert seen[1] is seen[0]  # the same objects: reused
    assert seen[2] is not seen[1] and seen[3] is not seen[2]  # another list or an equal copy: planned
    assert memo.plan(_batch(pool[1:7]), 300)[0] is not seen[4]  # another vocabulary: planned
    shared = [SamplingParams(temperature=0.0)] * 3
    batch = _batch(shared)
    assert memo.plan(batch, 259) == (plan_rows(batch, 259), False)
    batch.params[1] = SamplingParams(temperature=1.0, min_tokens=1)  # the caller's list, edited in place
    plan, may_edit = memo.plan(batch, 259)
    assert (plan.greedy, plan.full, may_edit) == ([0, 2], [1], True)


def _fields(p: SamplingParams) -> dict[str, object]:
    import attrs

    return {f.name: getattr(p, f.name) for f in attrs.fields(SamplingParams) if f.init}


@pytest.mark.parametrize("seed", SEEDS)
def test_a_sampler_reusing_its_plans_draws_what_fresh_samplers_draw(seed: int) -> None:
    rng = random.Random(seed)
    pool = [SamplingParams(temperature=rng.choice([0.0, 0.7, 1.2]), top_k=rng.choice([-1, 3, 100]),
                           top_p=rng.choice([1.0, 0.8]), seed=rng.choice([None, 7]),
                           repetition_penalty=rng.choice([1.0, 1.0, 1.3]), min_tokens=rng.choice([0, 0, 3]))
            for _ in range(10)]
    kept = VectorizedSampler(impl="ref")
    params = pool[:6]
    for step in range(6):
        if step % 3 == 2:
            params = rng.sample(pool, rng.randint(1, 8))
        logits = torch.randn(len(params), 259, generator=torch.Generator().manual_seed(seed * 10 + step))
        batch, fresh = _batch(params), _batch(params)
        fresh.output_token_ids = batch.output_token_ids = [
            tuple(rng.randrange(259) for _ in range(rng.randint(0, 4))) for _ in params]
        fresh.eos_token_ids = batch.eos_token_ids = [int(row.argmax()) for row in logits]  # min_tokens bites
        assert torch.equal(kept(logits, batch).token_ids, VectorizedSampler(impl="ref")(logits, fresh).token_ids)


def test_the_mask_memo_edits_exactly_what_edit_logits_edits() -> None:
    from deepinfer_kit.sample.logit_mask import MaskMemo, edit_logits

    plain = [SamplingParams(temperature=0.0) for _ in range(4)]
    biased = SamplingParams(temperature=0.0, logit_bias={3: 5.0}, logprobs=1)
    memo = MaskMemo()
    shared = _batch(plain)
    batches = [shared, _batch(plain), shared, _batch([*plain[:3], biased]), shared, _batch(plain[:2])]
    for step, batch in enumerate(batches):
        if step == 4:
            shared.params[2] = biased  # the list of an earlier round, edited in place
        logits = torch.randn(len(batch.params), 11, generator=torch.Generator().manual_seed(step))
        mine, reference = logits.clone(), logits.clone()
        raw = memo.edit(mine, batch, pin_memory=False)
        expected = edit_logits(reference, _batch(batch.params), pin_memory=False)
        assert torch.equal(mine, reference) and torch.equal(raw, expected), step
        assert (raw is mine) == (expected is reference)


def _follow(tokens: list[int], params: SamplingParams, *, lazy: bool, peek: int | None) -> tuple[str, object]:
    """Append ``tokens`` through the scheduler's append path to a request whose stream is
    its observer (eager) or not (lazy); ``peek``: read the text once after that many."""
    from deepinfer_kit.request import Request
    from deepinfer_kit.sched.stops import append_token

    tok = ByteTokenizer()
    req = Request("r", [1, 200, 3], params)
    stream = SequenceStream(req, IncrementalDetokenizer(tok, [1, 200, 3]), {}, lazy=lazy)
    if not lazy:
        req.observer = stream
    for i, t in enumerate(tokens):
        if i == peek:
            stream.text()
        if append_token(req, t, None, 10_000):
            break
    return stream.text(), (req.finish_reason, req.stop_reason, list(req.output_token_ids))


@pytest.mark.parametrize("seed", range(60))
def test_a_lazily_followed_sequence_ends_with_the_eager_text(seed: int) -> None:
    rng = random.Random(seed)
    tokens = [rng.choice([rng.randrange(128), rng.randrange(259), ord("x"), 257]) for _ in range(rng.randint(1, 25))]
    max_tokens = rng.randint(1, 25)
    params = SamplingParams(
        max_tokens=max_tokens, min_tokens=min(rng.choice([0, 0, 3]), max_tokens), ignore_eos=rng.random() < 0.3,
        stop_token_ids=rng.choice([[], [ord("x")]]), include_stop_str_in_output=rng.random() < 0.5,
        skip_special_tokens=rng.random() < 0.7,
    )
    assert SequenceStream.follows_lazily(params)
    peek = rng.choice([None, rng.randrange(len(tokens))])
    assert _follow(tokens, params, lazy=True, peek=peek) == _follow(tokens, params, lazy=False, peek=peek)


def test_only_a_request_read_when_it_ends_is_followed_lazily() -> None:
    from deepinfer_kit.sample.params import RequestOutputKind

    assert SequenceStream.follows_lazily(SamplingParams())
    assert SequenceStream.follows_lazily(SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY))
    for eager in (SamplingParams(n=2, temperature=1.0), SamplingParams(stop=["a"]), SamplingParams(logprobs=0),
                  SamplingParams(output_kind=RequestOutputKind.DELTA),
                  SamplingParams(output_kind=RequestOutputKind.CUMULATIVE)):
        assert not SequenceStream.follows_lazily(eager)


def test_the_engine_reports_the_same_texts_whether_it_follows_lazily_or_not() -> None:
    from deepinfer_kit import build_engine
    from deepinfer_kit.sample.params import RequestOutputKind

    texts = []
    for kind in (RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE):
        engine = build_engine(num_blocks=64, max_model_len=256)
        for i in range(6):
            engine.add_request(f"r{i}", [(5 * i + j) % 250 + 1 for j in range(6)], SamplingParams(
                max_tokens=40, output_kind=kind, stop_token_ids=[61, 138] if i % 2 else [],
                include_stop_str_in_output=i % 3 == 0, temperature=0.0 if i < 3 else 0.9, seed=i))
        outs = {o.request_id: o for o in engine.run() if o.finished}
        engine.check_idle()
        texts.append({k: (o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason)
                      for k, o in outs.items()})
    assert texts[0] == texts[1]
    assert any(reason == "stop" for _, _, reason in texts[0].values())
