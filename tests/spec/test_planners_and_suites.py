"""Verify-length planners (fixed, threshold, DSpark vs brute force) and the spec suites."""

from __future__ import annotations

import itertools
import random

import pytest

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sample.vectorized import VectorizedSampler
from deepinfer_kit.spec.verify.greedy import GreedyVerifier
from deepinfer_kit.spec.planners import DSparkPlanner, FixedPlanner, ThresholdPlanner, survival
from deepinfer_kit.spec.records import SpecConfig, SpsCurve
from deepinfer_kit.spec.verify.rejection import RejectionVerifier
from deepinfer_kit.testing.spec import DRAFT_VERIFIER_SUITE, VERIFY_PLANNER_SUITE
from deepinfer_kit.testing.suite import Check


def _concave_sps(rng: random.Random) -> SpsCurve:
    """A concave, decreasing (saturating) SPS curve sampled at 1..40 tokens."""
    base, slope, curve = rng.uniform(50, 200), rng.uniform(0.0, 3.0), rng.uniform(0.0, 0.3)
    xs = tuple(range(1, 41))
    return SpsCurve(xs, tuple(base - slope * x - curve * x * x + 1000 for x in xs))


def _theta(conf: list[list[float]], lengths: tuple[int, ...], sps: SpsCurve) -> float:
    tau = len(conf) + sum(sum(survival(c, n)) for c, n in zip(conf, lengths))
    return tau * sps(len(conf) + sum(lengths))


@pytest.mark.parametrize("seed", range(60))
def test_dspark_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    num_req, gamma = rng.randint(1, 4), rng.randint(1, 4)
    conf = [[rng.choice([rng.random(), 1.0, 0.0, 0.5]) for _ in range(gamma)] for _ in range(num_req)]
    max_lengths = [rng.randint(0, gamma) for _ in range(num_req)]
    sps = _concave_sps(rng)
    lengths = DSparkPlanner(sps).plan(conf, max_lengths)
    assert all(0 <= n <= m for n, m in zip(lengths, max_lengths))
    best = max(_theta(conf, choice, sps)
               for choice in itertools.product(*(range(m + 1) for m in max_lengths)))
    assert _theta(conf, tuple(lengths), sps) == pytest.approx(best, rel=1e-12)


def _theta_with_prefill(conf: list[list[float]], lengths: tuple[int, ...], sps: SpsCurve,
                        other: int) -> float:
    r = len(conf)
    tau = r + sum(sum(survival(c, n)) for c, n in zip(conf, lengths))
    step = 1 / sps(r + sum(lengths) + other) - 1 / sps(r + other) + 1 / sps(r)
    return tau / step


@pytest.mark.parametrize("seed", range(40))
def test_dspark_with_prefill_in_the_round_equals_brute_force(seed: int) -> None:
    rng = random.Random(1000 + seed)
    num_req, gamma, other = rng.randint(1, 4), rng.randint(1, 4), rng.randint(0, 36)
    conf = [[rng.choice([rng.random(), 1.0, 0.0, 0.5]) for _ in range(gamma)] for _ in range(num_req)]
    max_lengths = [rng.randint(0, gamma) for _ in range(num_req)]
    slope, curve = rng.uniform(0.0, 25.0), rng.uniform(0.0, 0.15)  # steeply concave, 1..56
    sps = SpsCurve(range(1, 57), [2000.0 - slope * x - curve * x * x for x in range(1, 57)])
    lengths = DSparkPlanner(sps).plan(conf, max_lengths, other)
    best = max(_theta_with_prefill(conf, choice, sps, other)
               for choice in itertools.product(*(range(m + 1) for m in max_lengths)))
    assert _theta_with_prefill(conf, tuple(lengths), sps, other) == pytest.approx(best, rel=1e-12)
    if other == 0:
        assert lengths == DSparkPlanner(sps).plan(conf, max_lengths)


def test_dspark_prices_drafts_at_the_rounds_real_size() -> None:
    # flat to 100 tokens, then 1 / B: 10 requests with 4 drafts each fit under the knee
    xs = tuple(range(1, 1001))
    sps = SpsCurve(xs, tuple(1000.0 if x <= 100 else 1e5 / x for x in xs))
    conf = [[0.3, 0.3, 0.3, 0.3]] * 10  # survival 0.3, 0.09, 0.027, 0.0081
    planner = DSparkPlanner(sps)
    assert planner.plan(conf, [4] * 10) == [4] * 10  # an idle device takes every draft
    # 90 prefill tokens put the round at the knee: a draft costs 1% of the round per
    # token, so only survivals above ~0.01 * tau pay
    at_knee = planner.plan(conf, [4] * 10, 90)
    assert sum(at_knee) < 40 and min(at_knee) >= 1
    # deeper past the knee the marginal cost is the same and the prefill pays for itself:
    # a 500-token prefill does not make the drafts look cheaper than a 90-token one
    assert planner.plan(conf, [4] * 10, 500) == planner.plan(conf, [4] * 10, 190)
    assert sum(planner.plan(conf, [4] * 10, 500)) <= sum(at_knee)


def test_dspark_grows_verification_when_the_device_is_idle_and_shrinks_it_when_busy() -> None:
    conf = [[0.9, 0.8, 0.7, 0.6]] * 4
    flat = SpsCurve((1, 1000), (100.0, 100.0))
    assert DSparkPlanner(flat).plan(conf, [4] * 4) == [4] * 4
    steep = SpsCurve((1, 4, 8, 100), (100.0, 100.0, 20.0, 1.0))
    assert sum(DSparkPlanner(steep).plan(conf, [4] * 4)) < 16


def test_fixed_and_threshold_planners() -> None:
    conf = [[0.9, 0.9, 0.5, 0.9], [0.2, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
    assert FixedPlanner().plan(conf, [4, 2, 0]) == [4, 2, 0]
    assert FixedPlanner(1).plan(conf, [4, 2, 0]) == [1, 1, 0]
    # survival: [0.9, 0.81, 0.405, 0.3645], [0.2, ...], [1, 1, 1, 1]
    assert ThresholdPlanner(0.5).plan(conf, [4, 4, 3]) == [2, 0, 3]
    assert ThresholdPlanner(0.0).plan(conf, [4, 4, 3]) == [4, 4, 3]
    assert ThresholdPlanner(1.5).plan(conf, [4, 4, 3]) == [0, 0, 0]
    with pytest.raises(ConfigError, match="threshold"):
        ThresholdPlanner(-1.0)


def test_spec_config_from_a_dict_and_bad_values() -> None:
    assert SpecConfig.coerce({"drafter": "ngram", "num_draft": 3}) == SpecConfig(num_draft=3)
    assert SpecConfig.coerce(None) is None
    with pytest.raises(ConfigError, match="unknown keys"):
        SpecConfig.coerce({"num_drafts": 3})
    with pytest.raises(ConfigError, match="num_draft"):
        SpecConfig(num_draft=0)
    with pytest.raises(ConfigError, match="planner"):
        SpecConfig(planner="best")
    with pytest.raises(ConfigError, match="batch_tokens must increase"):
        SpsCurve((4, 2), (1.0, 2.0))


_PLANNERS = {
    "fixed": FixedPlanner,
    "threshold": lambda: ThresholdPlanner(0.4),
    "dspark": lambda: DSparkPlanner(SpsCurve((1, 8, 64), (100.0, 90.0, 20.0))),
}


@pytest.mark.parametrize("name", sorted(_PLANNERS))
@pytest.mark.parametrize("check", VERIFY_PLANNER_SUITE.checks, ids=VERIFY_PLANNER_SUITE.ids)
def test_planner_suite(name: str, check: Check) -> None:  # type: ignore[type-arg]
    check(_PLANNERS[name])


@pytest.mark.parametrize("check", DRAFT_VERIFIER_SUITE.checks, ids=DRAFT_VERIFIER_SUITE.ids)
def test_verifier_suite(check: Check) -> None:  # type: ignore[type-arg]
    check(GreedyVerifier)
    check(lambda: RejectionVerifier(VectorizedSampler("ref")))
