"""The plan's decode rows (``SchedulePlan.decodes``, columns): each row is the
``DecodeChunk`` it stands for, the batch puts them first, and a sequence preempted after
it was planned leaves the plan with the planning order of the rest kept."""

from __future__ import annotations

import attrs

from deepinfer_kit.request import Request
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sched.planning import _unschedule
from deepinfer_kit.sched.records import DecodeChunk, DecodeRows, SamplingRow, ScheduledChunk, SchedulePlan
from deepinfer_kit.sched.state import InflightPlan
from deepinfer_kit.testing.sched_driver import make_request

ROW = SamplingRow(SamplingParams(), 3, [1, 2], 0, False)


def _rows(n: int, first: int = 0) -> DecodeRows:
    rows = DecodeRows()
    for i in range(first, first + n):
        rows.append(f"d{i}", 10 + i, 100 + i, [i, i + 1], i % 2, ROW, 5 + i)
    return rows


def _record(rid: str) -> ScheduledChunk:
    return ScheduledChunk(rid, 0, 4, [1, 2, 3, 4], [7], sampling=ROW)


def test_a_row_is_the_decode_chunk_it_stands_for() -> None:
    rows = _rows(3)
    chunk = rows.chunk(1)
    assert isinstance(chunk, DecodeChunk)
    expected = DecodeChunk("d1", 11, 1, [101], [1, 2], preemption_epoch=1, sampling=ROW, output_position=6)
    assert attrs.asdict(chunk, recurse=False) == attrs.asdict(expected, recurse=False)
    assert [c.request_id for c in rows.to_chunks()] == ["d0", "d1", "d2"]


def test_the_batch_is_the_rows_then_the_records() -> None:
    plan = SchedulePlan(step_id=1, chunks=[_record("p")], decodes=_rows(2))
    assert plan.num_chunks == 3 and not plan.is_empty
    assert plan.request_ids() == ["d0", "d1", "p"]
    assert [c.request_id for c in plan.all_chunks()] == ["d0", "d1", "p"]
    flat = plan.as_records()
    assert not flat.decodes.request_ids and [c.request_id for c in flat.chunks] == ["d0", "d1", "p"]
    assert plan.as_records().num_chunks == 3 and SchedulePlan(step_id=2).is_empty
    bare = SchedulePlan(step_id=3, chunks=[_record("q")])
    assert bare.as_records() is bare


def test_drop_removes_a_row_from_every_column() -> None:
    rows = _rows(3)
    rows.drop(1)
    assert rows.request_ids == ["d0", "d2"] and rows.starts == [10, 12] and rows.token_ids == [100, 102]
    assert rows.block_tables == [[0, 1], [2, 3]] and rows.preemption_epochs == [0, 0]
    assert rows.output_positions == [5, 7] and len(rows.sampling) == 2


def _entry() -> tuple[InflightPlan, list[Request], list[Request]]:
    """Planned in the order d0 d1 | p0 | d2 | p1 | d3 d4 (rows d*, records p*)."""
    decoders = [make_request(f"d{i}", 4) for i in range(5)]
    recorded = [make_request(f"p{i}", 4) for i in range(2)]
    plan = SchedulePlan(step_id=0, chunks=[_record("p0"), _record("p1")], decodes=_rows(5))
    entry = InflightPlan(plan, list(recorded), decode_requests=list(decoders),
                         plain=[(0, 2, 0), (2, 3, 1), (3, 5, 2)])
    return entry, decoders, recorded


def test_unscheduling_a_row_keeps_the_planning_order() -> None:
    entry, decoders, _ = _entry()
    assert _unschedule(entry, decoders[1]) == 1
    assert entry.plan.decodes.request_ids == ["d0", "d2", "d3", "d4"]
    assert [r.request_id for r in entry.decode_requests] == ["d0", "d2", "d3", "d4"]
    assert entry.plain == [(0, 1, 0), (1, 2, 1), (2, 4, 2)]
    assert _unschedule(entry, decoders[2]) == 1  # a range of one row goes
    assert entry.plain == [(0, 1, 0), (1, 3, 2)]


def test_unscheduling_a_record_keeps_the_planning_order() -> None:
    entry, _, recorded = _entry()
    assert _unschedule(entry, recorded[0]) == 4
    assert [c.request_id for c in entry.plan.chunks] == ["p1"]
    assert entry.plain == [(0, 2, 0), (2, 3, 0), (3, 5, 1)]
    assert _unschedule(entry, make_request("other", 4)) == 0  # not in the plan: nothing changes
    assert entry.plain == [(0, 2, 0), (2, 3, 0), (3, 5, 1)]
