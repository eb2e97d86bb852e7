"""Workloads, synthetic tokens, prompts, the analytic cost and the simulator's end-to-end
behaviour (reproducible, every block back, multi-turn prefix reuse)."""

from __future__ import annotations

import pytest

from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sim import (
    H200, QWEN3_1_7B, AnalyticCost, LengthDist, StepShape, SyntheticTokens, WorkloadConfig,
    build_simulator, generate,
)
from deepinfer_kit.sim.prompts import PromptBuilder
from deepinfer_kit.sim.trace_io import read_trace, write_trace


def test_workload_is_seeded_and_matches_its_config() -> None:
    cfg = WorkloadConfig(num_requests=3000, seed=3, rate=20.0, shared_fraction=0.3,
                         multi_turn_fraction=0.2, turns=3)
    a, b = generate(cfg), generate(cfg)
    assert [(r.request_id, r.arrival_time, r.prompt_len) for r in a] == [
        (r.request_id, r.arrival_time, r.prompt_len) for r in b]
    firsts = [r for r in a if r.after is None]
    assert firsts == sorted(firsts, key=lambda r: r.arrival_time)
    span = firsts[-1].arrival_time - firsts[0].arrival_time
    assert len(firsts) / span == pytest.approx(20.0, rel=0.1)
    assert sum(r.prompt_len for r in firsts) / len(firsts) == pytest.approx(500, rel=0.1)
    assert sum(r.shared_prefix >= 0 for r in firsts) / len(firsts) == pytest.approx(0.3, abs=0.05)
    assert all(r.after is not None for r in a if "." in r.request_id)
    bursty = generate(WorkloadConfig(num_requests=2000, arrival="bursty", burst_size=8.0))
    assert len({r.arrival_time for r in bursty}) < len(bursty) / 4  # bursts share a time
    with pytest.raises(ConfigError, match="shared_fraction"):
        WorkloadConfig(shared_fraction=1.5)
    with pytest.raises(ConfigError, match="KIND:MEAN"):
        LengthDist.parse("lognormal:x")


def test_synthetic_tokens_depend_only_on_request_and_position() -> None:
    t = SyntheticTokens(259, 257, seed=1)
    t.register("a", 5, stop_by_eos=True)
    seq = t.output("a", 5)
    assert seq[-1] == 257 and 257 not in seq[:-1] and all(0 <= x < 259 for x in seq)
    assert SyntheticTokens(259, 257, seed=1).output("a", 4) == seq[:4]
    assert SyntheticTokens(259, 257, seed=2).output("a", 4) != seq[:4]


@pytest.mark.parametrize("vocab,eos", [(259, 257), (259, 258), (259, 3), (7, None), (70000, 69999)])
def test_a_stretch_of_tokens_equals_token_by_token(vocab: int, eos: int | None) -> None:
    t = SyntheticTokens(vocab, eos, seed=4)
    t.register("a", 40, stop_by_eos=True)
    t.register("b", 9, stop_by_eos=False)
    for rid in ("a", "b", "unregistered"):
        for first, count in ((0, 50), (17, 23), (39, 1), (40, 5), (3, 0)):
            assert t.tokens(rid, first, count) == [t.token(rid, p) for p in range(first, first + count)]


def test_prompts_share_system_prompts_and_extend_history() -> None:
    reqs = generate(WorkloadConfig(num_requests=50, shared_fraction=1.0, shared_prefix_len=32))
    pb = PromptBuilder(1000, seed=0)
    p0, p1 = pb.build(reqs[0]), pb.build(reqs[1])
    assert p0[:32] == p1[:32] and len(p0) == reqs[0].prompt_len
    assert pb.build(reqs[0], history=[1, 2]) [:2] == [1, 2]


def test_analytic_cost_is_memory_bound_for_decode_and_compute_bound_for_prefill() -> None:
    cost = AnalyticCost(QWEN3_1_7B, H200)
    assert QWEN3_1_7B.num_params == pytest.approx(1.72e9, rel=0.02)
    weights_s = QWEN3_1_7B.num_params * 2 / 4.3e12
    decode = cost.step_time(StepShape(0, 1, 500, 1, 500, 1))
    assert decode == pytest.approx(weights_s + 3e-4, rel=0.02)  # plus the KV read
    prefill = cost.step_time(StepShape(8192, 0, 8192, 1, 8192 * 8193 // 2, 1))
    assert prefill == pytest.approx(2 * QWEN3_1_7B.layer_params * 8192 / 790e12, rel=0.5)
    assert prefill > 10 * decode


def test_simulation_is_reproducible_and_returns_every_block(tmp_path: object) -> None:
    cfg = WorkloadConfig(num_requests=300, rate=2000.0, seed=5, multi_turn_fraction=0.3,
                         prompt_len=LengthDist("lognormal", 300, 0.5, 8, 2000),
                         output_len=LengthDist("lognormal", 60, 0.5, 1, 400))
    reqs = generate(cfg)
    config = EngineConfig(num_blocks=400, max_model_len=4096)
    reports = []
    for _ in range(2):
        sim = build_simulator(config, AnalyticCost(QWEN3_1_7B, H200), QWEN3_1_7B)
        reports.append(sim.run(reqs))
        sim.cache.check_integrity(())
        assert sim.cache.num_free_blocks == sim.cache.num_blocks
    a, b = (r.summary() for r in reports)
    a.pop("wall_s"), b.pop("wall_s")
    assert a == b
    r = reports[0]
    assert r.num_finished == 300 and r.num_errors == 0
    assert r.prefix_hit_rate > 0.2  # follow-up turns reuse their history
    assert r.preemptions > 0  # a 6400-token pool under 2000 req/s
    path = str(tmp_path) + "/trace.jsonl"  # type: ignore[operator]
    write_trace(reqs, path)
    again = read_trace(path)
    assert [(x.request_id, x.after, x.prompt_len, x.output_len) for x in again] == [
        (x.request_id, x.after, x.prompt_len, x.output_len) for x in reqs]
