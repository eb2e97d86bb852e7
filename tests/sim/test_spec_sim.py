"""Speculative decoding in the simulator: the engine's drafting phase, the real planners
and scheduler, the synthetic drafter and verifying runner — outputs equal plain decoding,
accepted counts are consistent, every block returns to the pool; the saturating cost and
the SPS curve profiled from it; verified drafts priced as tokens."""

from __future__ import annotations

import pytest

from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.errors import ConfigError, InvariantError
from deepinfer_kit.request import Request
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sched.records import SchedulePlan
from deepinfer_kit.sim import H200, QWEN3_1_7B, AnalyticCost, SimRequest, StepShape, build_simulator
from deepinfer_kit.sim.acceptance import AcceptanceModel
from deepinfer_kit.sim.cost_saturating import SaturatingCost, profile_sps
from deepinfer_kit.sim.spec_build import build_spec_simulator
from deepinfer_kit.sim.spec_runner import check_idle
from deepinfer_kit.spec.planners import DSparkPlanner, FixedPlanner, ThresholdPlanner
from deepinfer_kit.spec.protocols import VerifyPlanner
from deepinfer_kit.step import StepResult

COST = SaturatingCost.from_shape(QWEN3_1_7B, H200)
SPS = profile_sps(COST, 1024)


class Recorder:
    """Collects each request's tokens and checks every verified chunk's counts."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.drafted = self.accepted = self.verify_rounds = 0

    def __call__(self, plan: SchedulePlan, result: StepResult, start: float, end: float) -> None:
        assert end >= start
        assert not any(c.spec_token_ids for c in plan.all_chunks())  # the runner drafts, into the room
        drafts = result.drafts or [() for _ in plan.all_chunks()]
        for i, (chunk, toks, spec) in enumerate(zip(plan.all_chunks(), result.token_ids, drafts)):
            self.tokens.setdefault(chunk.request_id, []).extend(toks)
            assert len(spec) <= chunk.draft_room
            if spec and chunk.sample:
                d, a = result.num_drafted[i], result.num_accepted[i]
                assert d == len(spec) and 0 <= a <= d and len(toks) == a + 1
                assert toks[:a] == list(spec[:a])
                assert a == d or toks[a] != spec[a]
                self.drafted, self.accepted = self.drafted + d, self.accepted + a
                self.verify_rounds += 1


def _requests(n: int) -> list[SimRequest]:
    return [SimRequest(f"q{i}", 0.001 * (i % 7), 20 + 13 * (i % 5), 10 + 17 * (i % 6),
                       stop_by_eos=i % 4 == 0) for i in range(n)]


@pytest.mark.parametrize("planner, gamma, lagged", [
    (FixedPlanner(4), 4, False), (ThresholdPlanner(0.4), 6, False), (DSparkPlanner(SPS), 8, False),
    (DSparkPlanner(SPS), 8, True),
])
def test_speculative_sim_equals_plain_and_ends_idle(planner: VerifyPlanner, gamma: int,
                                                    lagged: bool) -> None:
    # a small pool forces preemption; the budget trims drafts
    config = EngineConfig(max_num_seqs=12, max_num_batched_tokens=96, num_blocks=40,
                          block_size=8, max_model_len=256)
    reqs = _requests(30)
    plain_sim = build_simulator(config, COST, QWEN3_1_7B, seed=5)
    plain = Recorder()
    plain_report = plain_sim.run(_requests(30), observer=plain)
    check_idle(plain_sim)
    sim, spec = build_spec_simulator(config, COST, QWEN3_1_7B, acceptance=AcceptanceModel(seed=1),
                                     planner=planner, num_draft=gamma, seed=5, lagged=lagged)
    got = Recorder()
    report = sim.run(reqs, observer=got)
    check_idle(sim)
    assert report.num_requests == plain_report.num_requests == 30
    eos = sim.runner.tokens.eos_token_id
    for r in reqs:  # the synthetic target's tokens, as plain decoding emits them
        assert got.tokens[r.request_id] == plain.tokens[r.request_id]
        assert len(got.tokens[r.request_id]) == r.output_len
        assert (got.tokens[r.request_id][-1] == eos) == r.stop_by_eos
    assert got.verify_rounds > 0 and 0 < got.accepted < got.drafted
    assert spec.num_planned >= got.drafted  # the scheduler may trim what was planned
    assert report.duration_s < plain_report.duration_s  # fewer, cheaper-per-token rounds


def test_check_idle_names_what_is_held() -> None:
    config = EngineConfig(max_num_seqs=4, num_blocks=64, block_size=8, max_model_len=256)
    sim, _ = build_spec_simulator(config, COST, QWEN3_1_7B, acceptance=AcceptanceModel(),
                                  planner=FixedPlanner(2), num_draft=2)
    sim.run(_requests(3))
    check_idle(sim)
    sim.cache.allocate(_held_request(), 8)
    with pytest.raises(InvariantError, match="blocks still referenced"):
        check_idle(sim)


def _held_request() -> Request:
    return Request("leak", [1] * 8, SamplingParams(max_tokens=1))


def test_saturating_cost_is_flat_to_the_knee_then_inverse() -> None:
    knee = COST.knee_tokens
    assert 150 < knee < 220  # Qwen3-1.7B's weights vs its FLOPs per token on an H200
    assert SPS(1) == SPS(int(knee) - 1)
    assert SPS(1) == pytest.approx(1 / (COST.memory_s + COST.overhead_s), rel=1e-12)
    for b in (300, 4 * int(knee)):  # past the knee: every token's compute, plus the overhead
        assert SPS(b) * (b * (COST.token_s + COST.row_s) + COST.overhead_s) == pytest.approx(1.0, rel=1e-12)
    coarse = profile_sps(COST, 1024, stride=64)
    # the curve interpolates step time, which is linear past the knee: exact from the first
    # grid point past it (193), and beyond the profile along the last slope
    assert all(coarse(b) == pytest.approx(SPS(b), rel=1e-9) for b in range(193, 1025))
    assert coarse(4 * int(knee)) == pytest.approx(SPS(4 * int(knee)), rel=1e-9)
    assert coarse(150) < SPS(150)  # the interval holding the kink overstates the time
    with pytest.raises(ConfigError, match="max_tokens and stride"):
        profile_sps(COST, 0)
    with pytest.raises(ConfigError, match="token_s"):
        SaturatingCost(1e-3, -1.0)


def test_verified_drafts_are_priced_as_tokens() -> None:
    plain = StepShape(num_decode_rows=64, num_context_tokens=6400, num_sampled_rows=64,
                      attention_pairs=6400, num_chunks=64)
    spec = StepShape(num_decode_rows=64, num_context_tokens=6400 + 64 * 7, num_sampled_rows=64,
                     attention_pairs=6400 * 8, num_chunks=64, num_spec_tokens=64 * 7)
    for cost in (AnalyticCost(QWEN3_1_7B, H200), COST):
        assert cost.step_time(spec) > 2 * cost.step_time(plain) - COST.overhead_s
