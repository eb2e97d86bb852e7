"""The simulator's stretches of plain-decode rounds change nothing it reports: the same
workload with stretches on and off gives the same report (every percentile, the KV usage
series, step counts and busy time to the last bit), the same outputs and request times,
the same cache counters and clock — across pools that preempt, both batching modes, both
policies and both prefix indexes. And on a workload that decodes most of the time,
stretches do carry most rounds (so the comparison is not vacuous)."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.sim import H200, QWEN3_1_7B, AnalyticCost, LengthDist, WorkloadConfig, build_simulator, generate
from deepinfer_kit.sim.simulator import Simulator
from deepinfer_kit.testing.sim_cost import COST_MODEL_SUITE

_CASES = {
    "roomy": dict(num_blocks=20000),
    "preempting": dict(num_blocks=130),
    "static": dict(num_blocks=20000, scheduler="static", max_num_seqs=8),
    "priority-hash": dict(num_blocks=600, scheduler_policy="priority", prefix_index="hash"),
    "chunked-cap": dict(num_blocks=20000, long_prefill_token_threshold=64, max_num_batched_tokens=256),
    "no-prefix-cache": dict(num_blocks=20000, enable_prefix_caching=False),
}


def _workload(priority_levels: int) -> list[Any]:
    return generate(WorkloadConfig(
        num_requests=160, rate=40.0, seed=11, shared_fraction=0.4, shared_prefix_len=64,
        multi_turn_fraction=0.3, turns=3, think_time=0.05, eos_fraction=0.5,
        priority_levels=priority_levels,
        prompt_len=LengthDist("lognormal", 120, 0.6, 4, 600),
        output_len=LengthDist("lognormal", 60, 0.6, 1, 300),
    ))


def _run(config: EngineConfig, requests: list[Any], stretches: bool) -> tuple[Any, ...]:
    sim = build_simulator(config, AnalyticCost(QWEN3_1_7B, H200), QWEN3_1_7B)
    sim.stretches = stretches
    sched = sim.scheduler
    outputs: list[tuple[Any, ...]] = []
    commit, advance = sched.commit, sched.advance_plain_decodes  # type: ignore[attr-defined]
    applied = [0]

    def log(outs: Any) -> None:
        for o in outs:
            m = o.metrics
            outputs.append((o.request_id, o.outputs[0].token_ids, o.outputs[0].finish_reason,
                            o.num_cached_tokens, m.first_token_time, m.finished_time))

    def logged_commit(plan: Any, result: Any) -> Any:
        outs = commit(plan, result)
        log(outs)
        return outs

    def counted_advance(source: Any) -> Any:
        result = advance(source)
        applied[0] += len(result.frees)
        log(result.outputs)
        return result

    sched.commit = logged_commit  # type: ignore[method-assign]
    sched.advance_plain_decodes = counted_advance  # type: ignore[attr-defined]
    report = attrs.asdict(sim.run(requests))
    report.pop("wall_s")
    stats = sim.cache.stats
    state = (sim.clock.now, sim.runner.num_steps, sim.runner.busy_time, sim.cache.num_free_blocks,
             attrs.asdict(stats) if stats is not None else None)
    return report, outputs, state, applied[0], sim


@pytest.mark.parametrize("case", sorted(_CASES))
def test_stretches_change_nothing_reported(case: str) -> None:
    fields: dict[str, Any] = dict(_CASES[case])
    config = EngineConfig(max_model_len=2048, **fields)
    requests = _workload(3 if "priority" in case else 1)
    on = _run(config, requests, True)
    off = _run(config, requests, False)
    assert off[3] == 0
    for key in on[0]:
        assert on[0][key] == off[0][key], key
    assert on[1] == off[1]
    assert on[2] == off[2]
    assert on[0]["num_finished"] == len(requests)
    if case == "preempting":
        assert on[0]["preemptions"] > 0
    if case in ("roomy", "no-prefix-cache"):
        assert on[3] > on[0]["num_steps"] // 2, (on[3], on[0]["num_steps"])
    else:
        assert on[3] > 0


def test_an_observer_or_a_flag_turns_stretches_off() -> None:
    config = EngineConfig(max_model_len=2048, num_blocks=20000)
    requests = _workload(1)[:40]
    seen: list[int] = []
    sim: Simulator = build_simulator(config, AnalyticCost(QWEN3_1_7B, H200), QWEN3_1_7B)
    report = sim.run(requests, observer=lambda plan, result, start, end: seen.append(plan.step_id))
    assert seen == list(range(report.num_steps))  # the observer saw every round's plan
    off = _run(config, requests, False)
    assert off[3] == 0 and off[0]["num_steps"] == report.num_steps


class _Tick:
    """Every round takes 1/1024 s (exact in binary), so arrivals can fall exactly on a
    round's start."""

    def step_time(self, shape: Any) -> float:
        return 2.0 ** -10


def test_an_arrival_exactly_at_a_round_start_comes_before_that_round() -> None:
    config = EngineConfig(max_model_len=2048, num_blocks=20000)
    base = _workload(1)[:30]
    tick = 2.0 ** -10
    requests = [attrs.evolve(r, arrival_time=(7 * i + 3) * tick if r.after is None else r.arrival_time)
                for i, r in enumerate(base)]
    results = []
    for stretches in (True, False):
        sim = build_simulator(config, _Tick(), QWEN3_1_7B)  # type: ignore[arg-type]
        sim.stretches = stretches
        report = attrs.asdict(sim.run(requests))
        report.pop("wall_s")
        results.append(report)
    assert results[0] == results[1]


def _costs() -> list[Any]:
    from deepinfer_kit.sim.cost_analytic import TINY
    from deepinfer_kit.sim.cost_profiled import ProfiledCost
    from deepinfer_kit.sim.cost_saturating import SaturatingCost

    return [AnalyticCost(QWEN3_1_7B, H200), AnalyticCost(TINY, H200),
            ProfiledCost(1e-3, 2e-6, 3.5e-5, 1.25e-8), SaturatingCost(2e-3, 1e-6, 5e-6, 3e-4)]


@pytest.mark.parametrize("check", list(COST_MODEL_SUITE), ids=COST_MODEL_SUITE.ids)
@pytest.mark.parametrize("cost", _costs(), ids=["analytic-1.7b", "analytic-tiny", "profiled", "saturating"])
def test_cost_model_conformance(check: Any, cost: Any) -> None:
    """Every cost model passes the CostModel suite (its batch pricing, when it has one,
    gives the very floats ``step_time`` gives)."""
    check(lambda: cost)
