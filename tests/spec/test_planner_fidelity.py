"""The planners' rules pinned at their boundaries, and the DSpark planner against a brute-force
optimum of the paper's objective ``Θ = τ · SPS(B)`` on random survival tables and step-time
curves, and on an H200-shaped cost model profiled the way the engine profiles."""

from __future__ import annotations

import itertools
import random

import pytest

from deepinfer_kit.engine.runner.sps_profile import measure_sps, sps_points
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sim import H200, QWEN3_1_7B
from deepinfer_kit.sim.cost_saturating import SaturatingCost
from deepinfer_kit.sim.records import StepShape
from deepinfer_kit.spec.planners import DSparkPlanner, ThresholdPlanner, survival
from deepinfer_kit.spec.records import MAX_NUM_DRAFT, SpecConfig, SpsCurve


def test_threshold_survival_rule_verifies_a_draft_exactly_at_the_threshold() -> None:
    conf = [[0.5, 1.0, 0.5, 1.0]]  # survival 0.5, 0.5, 0.25, 0.25
    assert ThresholdPlanner(0.5).plan(conf, [4]) == [2]  # a == threshold is verified
    assert ThresholdPlanner(0.25).plan(conf, [4]) == [4]
    assert ThresholdPlanner(0.2500001).plan(conf, [4]) == [2]
    # threshold 0 verifies everything, zero confidences included
    assert ThresholdPlanner(0.0).plan([[0.0, 0.0, 0.0]], [3]) == [3]


def test_threshold_step_rule_reads_each_drafts_own_confidence() -> None:
    conf = [[0.6, 0.6, 0.6, 0.6, 0.6], [0.9, 0.3, 0.9, 0.9, 0.9]]
    assert ThresholdPlanner(0.5, rule="step").plan(conf, [5, 5]) == [5, 1]
    assert ThresholdPlanner(0.5).plan(conf, [5, 5]) == [1, 1]  # survival 0.6, 0.36, ...
    assert ThresholdPlanner(0.6, rule="step").plan(conf, [5, 3]) == [5, 1]  # == is verified
    assert ThresholdPlanner(0.0, rule="step").plan([[0.0, 0.0]], [2]) == [2]
    with pytest.raises(ConfigError, match="rule"):
        ThresholdPlanner(0.5, rule="prefix")
    assert SpecConfig(planner="threshold", threshold_rule="step").threshold_rule == "step"
    with pytest.raises(ConfigError, match="threshold_rule"):
        SpecConfig(threshold_rule="each")


def test_dspark_never_verifies_a_draft_of_zero_survival() -> None:
    flat = SpsCurve((1, 10_000), (100.0, 100.0))  # every draft is free
    conf = [[0.9, 0.0, 0.9], [0.0, 0.9, 0.9], [1.0, 1.0, 1.0]]
    assert DSparkPlanner(flat).plan(conf, [3, 3, 3]) == [1, 0, 3]


def test_dspark_stops_when_a_draft_does_not_raise_theta() -> None:
    # the paper's Appendix A curve: Θ0 = 1.0, Θ1 = 1.8 * 0.5 = 0.9: verify nothing
    curve = SpsCurve((1, 2, 3), (1.0, 0.5, 0.45))
    assert DSparkPlanner(curve).plan([[0.8, 0.9]], [2]) == [0]
    # a draft that leaves Θ exactly unchanged is not verified either (Θ must rise)
    curve = SpsCurve((1, 2), (1.0, 1.0 / 1.5))
    assert DSparkPlanner(curve).plan([[0.5]], [1]) == [0]


def _random_time_curve(rng: random.Random, top: int) -> list[float]:
    """A step time that is non-decreasing and convex in B (a roofline with a knee, plus a
    gentle quadratic), at every B in 1..top."""
    flat, knee = rng.uniform(0.5, 2.0), rng.randint(1, top)
    slope, bend = rng.uniform(0.0, 0.5), rng.uniform(0.0, 0.01)
    return [flat + slope * max(0, b - knee) + bend * max(0, b - knee) ** 2 for b in range(1, top + 1)]


def _theta(conf: list[list[float]], lengths: tuple[int, ...], curve: SpsCurve) -> float:
    tau = len(conf) + sum(sum(survival(c, n)) for c, n in zip(conf, lengths))
    return tau * curve(len(conf) + sum(lengths))


def test_dspark_is_within_2_percent_of_the_brute_force_optimum_on_1000_random_cases() -> None:
    rng = random.Random(2026)
    gaps = []
    for _ in range(1000):
        num_req, gamma = rng.randint(1, 4), rng.randint(1, 4)
        conf = [[rng.choice([rng.random(), rng.random(), 1.0, 0.0, 0.5]) for _ in range(gamma)]
                for _ in range(num_req)]
        max_lengths = [rng.randint(0, gamma) for _ in range(num_req)]
        top = num_req * (gamma + 1)
        curve = SpsCurve(range(1, top + 1), [1.0 / t for t in _random_time_curve(rng, top)])
        lengths = DSparkPlanner(curve).plan(conf, max_lengths)
        assert all(0 <= n <= m for n, m in zip(lengths, max_lengths))
        best = max(_theta(conf, choice, curve)
                   for choice in itertools.product(*(range(m + 1) for m in max_lengths)))
        gaps.append(1.0 - _theta(conf, tuple(lengths), curve) / best)
    assert max(gaps) <= 0.02, max(gaps)
    assert sum(gaps) / len(gaps) < 1e-9  # convex step times: the early stop is exact


def test_dspark_on_an_h200_profile_at_128_sequences_verifies_near_the_optimal_count() -> None:
    cost = SaturatingCost.from_shape(QWEN3_1_7B, H200)

    def step_time(tokens: int) -> float:
        return cost.step_time(StepShape(0, tokens, tokens, tokens, tokens, tokens))

    curve = measure_sps(step_time, sps_points(2048))  # as the engine profiles at start
    num_req, gamma = 128, 4
    conf = [[0.5] * gamma] * num_req
    count = sum(DSparkPlanner(curve).plan(conf, [gamma] * num_req))
    ranked = sorted((a for c in conf for a in survival(c, gamma)), reverse=True)

    def theta(k: int) -> float:
        return (num_req + sum(ranked[:k])) / step_time(num_req + k)

    optimal = max(range(len(ranked) + 1), key=theta)
    assert 0 < count <= 1.5 * optimal, (count, optimal)
    assert theta(count) >= 0.98 * theta(optimal)


def test_sps_curve_interpolates_step_time_and_extends_its_last_slope() -> None:
    curve = SpsCurve((1, 100, 200), (100.0, 100.0, 50.0))  # 10 ms flat, then +0.1 ms / token
    assert curve.step_time(150) == pytest.approx(0.015)  # time, not SPS, is linear
    assert curve(150) == pytest.approx(1 / 0.015)
    assert curve.step_time(400) == pytest.approx(0.040)  # past the end, along the last slope
    assert curve(0) == 100.0
    assert SpsCurve((8,), (5.0,))(1000) == 5.0  # one point: constant
    assert SpsCurve((1, 8), (5.0, 10.0)).step_time(100) == pytest.approx(0.1)  # never faster


def test_num_draft_is_bounded_at_config_time() -> None:
    for bad in (0, MAX_NUM_DRAFT + 1, 10**9, True, 2.0):
        with pytest.raises(ConfigError, match="speculative.num_draft"):
            SpecConfig(num_draft=bad)  # type: ignore[arg-type]
    assert SpecConfig(num_draft=MAX_NUM_DRAFT).num_draft == MAX_NUM_DRAFT
