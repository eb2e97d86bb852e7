"""Metrics: percentiles against hand-computed values; a hand-built run's report."""

from __future__ import annotations

import math

import pytest

from deepinfer_kit.outputs import CompletionOutput, RequestMetrics, RequestOutput
from deepinfer_kit.sched.records import SchedulePlan
from deepinfer_kit.sim import MetricsRecorder, Percentiles, percentile


def test_percentile_interpolates_between_closest_ranks() -> None:
    xs = [15.0, 20.0, 35.0, 40.0, 50.0]
    assert percentile(xs, 0) == 15.0
    assert percentile(xs, 100) == 50.0
    assert percentile(xs, 50) == 35.0
    assert percentile(xs, 40) == pytest.approx(29.0)  # rank 1.6: 20 + 0.6 * 15
    assert percentile(xs, 90) == pytest.approx(46.0)  # rank 3.6: 40 + 0.6 * 10
    assert percentile(list(reversed(xs)), 90) == pytest.approx(46.0)  # order-free
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    hundred = [float(i) for i in range(1, 101)]
    assert percentile(hundred, 99) == pytest.approx(99.01)
    assert Percentiles.of(hundred) == Percentiles(50.5, pytest.approx(90.1), pytest.approx(99.01), 50.5)


def _out(rid: str, arrival: float, sched: float, first: float, done: float, n: int,
         reason: str = "length", cached: int = 0, prompt: int = 10) -> RequestOutput:
    return RequestOutput(
        rid, None, list(range(prompt)),
        [CompletionOutput(0, "", list(range(n)), finish_reason=reason)], True, cached,
        RequestMetrics(arrival, sched, first, done),
    )


def test_report_of_a_hand_built_run() -> None:
    m = MetricsRecorder()
    for t in (0.0, 1.0, 2.0):
        m.on_arrival(t)
    m.on_step(SchedulePlan(0, preempted_ids=["b"]), 0.0, 2.0, 0.5)
    m.on_step(SchedulePlan(1), 2.0, 2.0, 1.0)
    m.on_finish(_out("a", 0.0, 0.5, 1.0, 5.0, 5, cached=4))  # ttft 1, tpot 1, e2e 5
    m.on_finish(_out("b", 1.0, 1.0, 4.0, 4.0, 1, reason="stop"))  # ttft 3, e2e 3
    m.on_finish(_out("c", 2.0, 2.0, 2.0, 2.0, 0, reason="error"))
    r = m.report(wall_s=0.1)
    assert (r.num_requests, r.num_finished, r.num_errors, r.num_stopped) == (3, 3, 1, 1)
    assert r.duration_s == 5.0 and r.output_tokens == 6 and r.output_throughput == 6 / 5
    assert r.request_throughput == 2 / 5
    assert r.ttft.p50 == pytest.approx(2.0) and r.ttft.p99 == pytest.approx(2.98)
    assert r.e2e.mean == pytest.approx(4.0) and r.queueing.p50 == pytest.approx(0.25)
    assert r.tpot.p50 == pytest.approx(1.0)  # b has one token: no TPOT
    assert r.prefix_hit_rate == pytest.approx(4 / 20)
    assert r.preemptions == 1
    assert r.kv_usage_mean == pytest.approx(0.75) and r.kv_usage_max == 1.0
    assert r.per_user_tokens_per_s == pytest.approx((5 / 5 + 1 / 3) / 2)
    assert r.summary()["ttft_p50_ms"] == pytest.approx(2000.0)


def test_latencies_are_also_reported_per_priority_level() -> None:
    m = MetricsRecorder()
    m.on_finish(_out("a", 0.0, 0.5, 1.0, 5.0, 5), priority=1)  # ttft 1, tpot 1, e2e 5
    m.on_finish(_out("b", 1.0, 1.0, 4.0, 4.0, 1), priority=0)  # ttft 3, e2e 3
    m.on_finish(_out("c", 0.0, 2.0, 3.0, 7.0, 3), priority=1)  # ttft 3, tpot 2, e2e 7
    m.on_finish(_out("d", 2.0, 2.0, 2.0, 2.0, 0, reason="error"), priority=2)
    r = m.report(wall_s=0.1)
    assert [p.priority for p in r.by_priority] == [0, 1]  # errors make no latency
    low, high = r.by_priority
    assert low.num_finished == 1 and high.num_finished == 2
    assert low.ttft.p50 == pytest.approx(3.0) and math.isnan(low.tpot.p50)
    assert high.ttft.mean == pytest.approx(2.0) and high.tpot.mean == pytest.approx(1.5)
    assert high.e2e.p99 == pytest.approx(6.98) and high.queueing.p50 == pytest.approx(1.25)
    assert r.ttft.mean == pytest.approx(7 / 3)  # the overall figures are unchanged
    row = r.summary()
    assert row["prio1_requests"] == 2 and row["prio0_ttft_p50_ms"] == pytest.approx(3000.0)
    assert row["prio1_tpot_p99_ms"] == pytest.approx(1990.0)
    one = MetricsRecorder()
    one.on_finish(_out("a", 0.0, 0.5, 1.0, 5.0, 5))
    assert len(one.report(0.1).by_priority) == 1
    assert not any(k.startswith("prio") for k in one.report(0.1).summary())
