"""PlanEncoder / PlanDecoder: plans cross to a worker process unchanged, each sequence's
row and table sent in full only until the worker confirmed it, and both sides agree on
what the worker holds after any mix of confirmations, rejections and forgotten sequences."""

from __future__ import annotations

import pickle
import random

import attrs
import pytest

from deepinfer_kit import SamplingParams
from deepinfer_kit.engine.remote.plan_codec import PlanDecoder, PlanEncoder
from deepinfer_kit.sched.records import DecodeRows, SamplingRow, ScheduledChunk, SchedulePlan


def _fields(plan: SchedulePlan) -> tuple[object, ...]:
    chunks = tuple(
        tuple((f.name, _row(getattr(c, f.name)) if f.name == "sampling" else getattr(c, f.name))
              for f in attrs.fields(ScheduledChunk))
        for c in plan.all_chunks()
    )
    return (plan.step_id, chunks, plan.block_copies, plan.preempted_ids, plan.finished_ids,
            plan.num_batched_tokens, plan.token_budget, plan.num_cached_tokens)


def _row(row: SamplingRow | None) -> object:
    if row is None:
        return None
    return (row.params, row.seed, list(row.prompt_token_ids), row.eos_token_id, row.needs_history)


class Sequences:
    """A seeded population of sequences whose rows never change and whose tables grow,
    get replaced (preemption) and sometimes return to an object used before."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.rows: dict[str, SamplingRow] = {}
        self.tables: dict[str, list[int]] = {}
        self.old_tables: dict[str, list[int]] = {}
        self.count = 0

    def chunk(self, rid: str) -> ScheduledChunk:
        rng = self.rng
        if rid not in self.rows or rng.random() < 0.03:  # a new row object (re-admission)
            params = SamplingParams(temperature=rng.choice([0.0, 0.7]), top_k=rng.choice([0, 5]),
                                    seed=rng.randrange(100), max_tokens=rng.randint(1, 30))
            self.rows[rid] = SamplingRow(params, params.seed, [rng.randrange(250) for _ in range(rng.randint(1, 9))],
                                         257, rng.random() < 0.3)
        draw = rng.random()
        if rid not in self.tables or draw < 0.2:  # the table grew: a new copy
            old = self.tables.get(rid, [])
            self.old_tables[rid] = old
            self.tables[rid] = [*old, rng.randrange(500)]
        elif draw < 0.25:  # back to an object sent before (the encoder must not trust it)
            self.tables[rid], self.old_tables[rid] = self.old_tables[rid], self.tables[rid]
        row = self.rows[rid] if rng.random() < 0.85 else None
        n = rng.randint(1, 3)
        return ScheduledChunk(
            rid, rng.randrange(50), n, [rng.randrange(250) for _ in range(n)], self.tables[rid],
            row is not None, rng.choice([1, 1, 2]), tuple(rng.randrange(250) for _ in range(rng.choice([0, 0, 2]))),
            rng.choice([0, 0, 1]), rng.randrange(3), row, rng.choice([0, 16]), rng.randrange(20),
            (1, 2) if row is not None and row.needs_history else (), (), 0, 0,
            rng.choice([0, 0, 2]), rng.choice([0, 3]),
        )

    def plan(self, step: int, live: list[str]) -> SchedulePlan:
        """Some sequences as decode rows (columns), some as chunk records."""
        rng = self.rng
        chunks: list[ScheduledChunk] = []
        rows = DecodeRows()
        for rid in live:
            if rng.random() < 0.2:
                continue
            chunk = self.chunk(rid)
            row = chunk.sampling
            if row is not None and not row.needs_history and rng.random() < 0.5:
                rows.append(rid, chunk.start, chunk.token_ids[0], chunk.block_table, chunk.preemption_epoch, row,
                            chunk.output_position)
            else:
                chunks.append(chunk)
        return SchedulePlan(step, chunks, [(1, 2)] if rng.random() < 0.1 else [],
                            ["p"] if rng.random() < 0.1 else [], [], sum(c.num_tokens for c in chunks) + len(rows),
                            64, 0, rows)


@pytest.mark.parametrize("seed", range(16))
def test_random_plans_cross_unchanged_under_confirms_rejects_and_lag(seed: int) -> None:
    rng = random.Random(seed)
    seqs = Sequences(rng)
    encoder, decoder = PlanEncoder(), PlanDecoder()
    live = [f"s{i}" for i in range(6)]
    in_flight: list[tuple[int, bytes, SchedulePlan]] = []
    for step in range(300):
        if rng.random() < 0.2:
            live.remove(rng.choice(live)) if len(live) > 1 else None
        if rng.random() < 0.25:
            seqs.count += 1
            live.append(f"n{seqs.count}")
        plan = seqs.plan(step, live)
        message, data = encoder.encode(plan)
        in_flight.append((message, data, plan))
        while len(in_flight) > rng.choice([1, 2, 3]):  # replies lag behind the sends
            message, data, sent = in_flight.pop(0)
            if rng.random() < 0.08:  # the worker could not decode it: nothing is held of it
                encoder.reject(message)
                continue
            got_message, got = decoder.decode(data)
            assert got_message == message
            assert _fields(got) == _fields(sent)
            encoder.confirm(message)
    for message, data, sent in in_flight:
        assert _fields(decoder.decode(data)[1]) == _fields(sent)
        encoder.confirm(message)


def test_a_decode_round_names_what_the_worker_holds() -> None:
    rows = {f"r{i}": SamplingRow(SamplingParams(temperature=0.8, seed=i), i, list(range(200)), 257, False)
            for i in range(32)}
    tables = {rid: list(range(12)) for rid in rows}

    def plan(step: int) -> SchedulePlan:
        decodes = DecodeRows()
        for i, (rid, row) in enumerate(rows.items()):
            decodes.append(rid, 100 + step, step, tables[rid], i % 3, row, step + i)
        return SchedulePlan(step, decodes=decodes)

    encoder, decoder = PlanEncoder(), PlanDecoder()
    first = encoder.encode(plan(0))
    second = encoder.encode(plan(1))  # the overlapped engine sends k + 1 before k's reply
    decoder.decode(first[1])
    encoder.confirm(first[0])
    third = encoder.encode(plan(2))
    assert len(second[1]) == len(first[1])  # nothing confirmed yet: all in full again
    assert len(third[1]) * 10 < len(first[1]), (len(first[1]), len(third[1]))
    assert len(third[1]) * 10 < len(pickle.dumps(plan(2)))
    decoder.decode(second[1])
    encoder.confirm(second[0])
    _, got = decoder.decode(third[1])
    assert _fields(got) == _fields(plan(2))
    assert got.decodes.sampling[5] is not None and list(got.decodes.sampling[5].prompt_token_ids) == list(range(200))


def test_sequences_a_plan_no_longer_uses_are_forgotten_on_both_sides() -> None:
    encoder, decoder = PlanEncoder(), PlanDecoder()
    row = SamplingRow(SamplingParams(), None, [1, 2], None, False)

    def send(rids: list[str], step: int) -> None:
        message, data = encoder.encode(SchedulePlan(step, [ScheduledChunk(r, 0, 1, [1], [step], sampling=row) for r in rids]))
        decoder.decode(data)
        encoder.confirm(message)

    send(["a", "b", "c"], 0)
    assert decoder.num_held == encoder.num_known == (3, 3)
    send(["b"], 1)
    assert decoder.num_held == encoder.num_known == (1, 1)
    send(["a", "b"], 2)  # "a" is back: sent in full again, never named
    assert decoder.num_held == (2, 2)


def test_an_unconfirmed_value_is_sent_in_full_again() -> None:
    encoder, decoder = PlanEncoder(), PlanDecoder()
    table = [4, 5, 6]
    chunk = ScheduledChunk("a", 0, 1, [1], table)
    first = encoder.encode(SchedulePlan(0, [chunk]))
    second = encoder.encode(SchedulePlan(1, [chunk]))  # before the reply to the first
    encoder.reject(first[0])
    assert decoder.decode(second[1])[1].chunks[0].block_table == table  # decodable alone
    encoder.confirm(second[0])
    third = encoder.encode(SchedulePlan(2, [chunk]))
    assert len(third[1]) < len(second[1])
    assert decoder.decode(third[1])[1].chunks[0].block_table == table


def test_an_unpicklable_plan_changes_nothing() -> None:
    encoder = PlanEncoder()
    bad = SamplingRow(SamplingParams(), None, [1], None, False)
    object.__setattr__(bad, "prompt_token_ids", (i for i in range(3)))  # a generator
    with pytest.raises(TypeError):
        encoder.encode(SchedulePlan(0, [ScheduledChunk("a", 0, 1, [1], [0], sampling=bad)]))
    assert encoder.num_known == (0, 0)
    message, data = encoder.encode(SchedulePlan(0, [ScheduledChunk("a", 0, 1, [1], [0])]))
    assert message == 0 and PlanDecoder().decode(data)[1].chunks[0].request_id == "a"
