"""The DSpark planner's whole-walk rule (``plan_budgeted``) on step-shaped (staircase) and
other non-decreasing step-time curves: against a brute-force optimum of ``Θ = τ / t(B)``
over every prefix-closed selection on small instances, against the best total of the walk
computed independently on 1,000 random staircases of the issue's sizes, and on the
issue's ladder; the round-to-round budget (``RoundPlanner``) and the online correction of
the curve (``MeasuredSps``)."""

from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

import pytest

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.spec.planners import DSparkPlanner, FixedPlanner, survival
from deepinfer_kit.spec.planning import RoundPlanner
from deepinfer_kit.spec.records import SpecConfig, SpsCurve
from deepinfer_kit.spec.sps_online import MeasuredSps
from deepinfer_kit.spec.speculation import build_speculation

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from spec_staircase import random_staircase  # noqa: E402  (the benchmark's curves, the same draws)

LADDER = SpsCurve.ladder([64, 128, 256, 512, 1024, 2048], [9e-3, 9.5e-3, 10e-3, 12e-3, 20e-3, 40e-3])


def _theta(conf: list[list[float]], lengths: list[int] | tuple[int, ...], curve: SpsCurve,
           other: int = 0) -> float:
    num_req = len(conf)
    tau = num_req + sum(sum(survival(c, n)) for c, n in zip(conf, lengths))
    prefill_s = curve.step_time(num_req + other) - curve.step_time(num_req)
    return tau / (curve.step_time(num_req + other + sum(lengths)) - prefill_s)


def _random_linear(rng: random.Random, top: int) -> SpsCurve:
    """Any non-decreasing step time, read linearly between its points (not convex)."""
    times, t = [], rng.uniform(0.5, 2.0)
    for _ in range(top):
        t += rng.choice([0.0, rng.random(), 5 * rng.random()])
        times.append(t)
    return SpsCurve(range(1, top + 1), [1.0 / t for t in times])


def _random_conf(rng: random.Random, num_req: int, gamma: int) -> list[list[float]]:
    mean = rng.random()
    return [[min(1.0, max(0.0, rng.gauss(mean, 0.25))) for _ in range(gamma)] for _ in range(num_req)]


def test_the_issue_ladder_verifies_256_tokens_where_the_early_stop_verifies_none() -> None:
    conf = [[0.8] * 4] * 64
    planner = DSparkPlanner(LADDER)
    assert sum(planner.plan(conf, [4] * 64)) == 0  # the first step up stops the early stop
    lengths = planner.plan_budgeted(conf, [4] * 64, 0, conf)
    assert 64 + sum(lengths) == 256
    assert _theta(conf, lengths, LADDER) == pytest.approx(188.89 / 10e-3, rel=1e-3)


@pytest.mark.parametrize("seed", range(6))
def test_the_whole_walk_equals_brute_force_over_prefix_closed_selections(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(150):
        num_req, gamma = rng.randint(1, 4), rng.randint(1, 3)
        conf = [[rng.choice([rng.random(), rng.random(), 1.0, 0.0, 0.5]) for _ in range(gamma)]
                for _ in range(num_req)]
        max_lengths = [rng.randint(0, gamma) for _ in range(num_req)]
        other = rng.choice([0, 0, rng.randint(1, 6)])
        top = num_req * (gamma + 1) + other
        curve = (random_staircase(rng, rng.randint(1, top), top) if top > 1 and rng.random() < 0.7
                 else _random_linear(rng, top + 1))
        lengths = DSparkPlanner(curve).plan_budgeted(conf, max_lengths, other, conf)
        assert all(0 <= n <= m for n, m in zip(lengths, max_lengths))
        best = max(_theta(conf, choice, curve, other)
                   for choice in itertools.product(*(range(m + 1) for m in max_lengths)))
        assert _theta(conf, lengths, curve, other) == pytest.approx(best, rel=1e-12)


def test_within_1_percent_of_the_optimum_on_1000_random_staircases() -> None:
    """8-32 steps, 16-256 rows, γ <= 8: the optimum over prefix-closed selections is the
    best top-k total (an exchange argument the brute-force test above checks on small
    instances), computed here from scratch for every k. The early stop is reported."""
    rng = random.Random(44)
    ratios, early = [], []
    for _ in range(1000):
        num_req, gamma = rng.randint(16, 256), rng.randint(1, 8)
        conf = _random_conf(rng, num_req, gamma)
        top = num_req * (gamma + 1)
        curve = random_staircase(rng, rng.randint(8, 32), top + rng.randint(0, top))
        ranked = sorted((a for row in conf for a in survival(row, gamma) if a > 0.0), reverse=True)
        prefix = [float(num_req)]
        for a in ranked:
            prefix.append(prefix[-1] + a)
        best = max(prefix[k] / curve.step_time(num_req + k) for k in range(len(ranked) + 1))
        planner = DSparkPlanner(curve)
        ratios.append(_theta(conf, planner.plan_budgeted(conf, [gamma] * num_req, 0, conf), curve) / best)
        early.append(_theta(conf, planner.plan(conf, [gamma] * num_req), curve) / best)
    assert min(ratios) >= 0.99, min(ratios)
    assert min(ratios) == pytest.approx(1.0, rel=1e-9)
    # the early stop this replaces: far from the optimum on staircases
    assert min(early) < 0.8 and sum(r < 0.99 for r in early) > 300, (min(early), sum(r < 0.99 for r in early))


def test_the_budget_sets_the_total_and_this_rounds_confidences_split_it() -> None:
    planner = DSparkPlanner(LADDER)
    conf = [[0.9] * 4] * 32 + [[0.1] * 4] * 32
    assert sum(planner.plan_budgeted(conf, [4] * 64, 0, conf)) == 192  # its own walk
    budget = [[0.2] * 4] * 64  # a walk that stops at 128 tokens: one draft per row
    lengths = planner.plan_budgeted(conf, [4] * 64, 0, budget)
    assert lengths == [2] * 32 + [0] * 32  # 64 drafts, the best survivals of this round
    ties = planner.plan_budgeted([[0.5] * 4] * 64, [4] * 64, 0, budget)
    assert ties == [1] * 64  # equal survivals: earlier drafts first, then lower rows
    # a request never verifies a draft of zero survival, whatever the budget
    assert planner.plan_budgeted([[0.0] * 4] * 64, [4] * 64, 0, [[1.0] * 4] * 64) == [0] * 64


def test_round_planner_budgets_from_each_requests_previous_round() -> None:
    seen: list[tuple[list[list[float]], list[list[float]]]] = []

    class Spy(DSparkPlanner):
        def plan_budgeted(self, confidence, max_lengths, other_tokens, budget_confidence):  # type: ignore[no-untyped-def]
            seen.append(([list(r) for r in confidence], [list(r) for r in budget_confidence]))
            return super().plan_budgeted(confidence, max_lengths, other_tokens, budget_confidence)

    rounds = RoundPlanner(Spy(LADDER))
    rounds.plan(["a", "b"], [0, 0], [[0.5, 0.4, 0.3], [0.9, 0.1, 0.8]], [3, 3])
    assert seen[-1][1] == [[0.5] * 3, [0.9] * 3]  # first round: c_{r,0} repeated
    # "b" emitted 3 tokens (positions 0-2): c'_0..c'_3 read only drafts at positions < 3
    rounds.plan(["b", "c"], [3, 0], [[0.3, 0.3, 0.3], [0.7, 0.2, 0.1]], [3, 3])
    assert seen[-1] == ([[0.3, 0.3, 0.3], [0.7, 0.2, 0.1]], [[0.9, 0.1, 0.8], [0.7, 0.7, 0.7]])
    # "b" now emitted 1 token: c'_2 read the draft at position 4, which this round draws again
    rounds.plan(["b"], [4], [[0.6, 0.5, 0.4]], [3])
    assert seen[-1][1] == [[0.3, 0.3, 0.3]]
    rounds.plan(["b"], [5], [[0.1, 0.1, 0.1]], [3])
    assert seen[-1][1] == [[0.6, 0.5, 0.5]]  # c'_0, c'_1 kept, c'_1 stands in for c'_2
    rounds.plan(["a"], [9], [[0.2, 0.2, 0.2]], [3])
    assert seen[-1][1] == [[0.2] * 3]  # "a" sat rounds out: its history went
    lagged = RoundPlanner(Spy(LADDER), lagged=True)
    lagged.plan(["a"], [0], [[0.5, 0.4]], [2])
    assert seen[-1] == ([[0.0, 0.0]], [[0.0, 0.0]])
    lagged.plan(["a"], [2], [[0.6, 0.3, 0.2]], [3])
    assert seen[-1] == ([[0.5, 0.4, 0.4]], [[0.5, 0.4, 0.4]])
    lagged.plan(["a"], [3], [[0.7, 0.7, 0.7]], [3])
    assert seen[-1] == ([[0.6, 0.3, 0.3]], [[0.6, 0.3, 0.3]])  # one token: c'_0, c'_1 kept
    # a planner without a budget sees this round's rows only
    assert RoundPlanner(FixedPlanner(1)).plan(["a"], [0], [[0.1, 0.1]], [2]) == [1]


def test_measured_sps_scales_each_count_by_the_median_of_its_last_rounds() -> None:
    base = SpsCurve.ladder([4, 8, 16], [1.0, 2.0, 4.0])
    online = MeasuredSps(base, window=3, min_samples=2)
    assert not online.observe(3, 1.5)  # one sample of count 4: not enough yet
    assert online.curve is base
    assert online.observe(4, 2.0)  # ratios 1.5, 2.0: median 1.75
    assert online.curve.step_time(4) == pytest.approx(1.75)
    assert online.curve.step_time(8) == pytest.approx(2.0)  # untouched: made non-decreasing
    for s in (100.0, 1.0, 1.0):  # the window keeps the last 3: 1.0, 1.0 and the outlier
        online.observe(4, s)
    assert online.curve.step_time(4) == pytest.approx(1.0)
    assert online.curve.staircase and online.ratios() == [1.0, 1.0, 1.0]
    online.observe(16, 2.0), online.observe(40, 2.0)  # past the end: the last count
    assert online.ratios()[2] < 1.0 and online.curve.step_time(8) <= online.curve.step_time(16)
    assert not online.observe(0, 1.0) and not online.observe(4, float("nan"))
    with pytest.raises(ConfigError, match="min_samples"):
        MeasuredSps(base, window=3, min_samples=4)


def test_an_online_curve_is_only_for_the_dspark_planner() -> None:
    with pytest.raises(ConfigError, match="sps_online"):
        SpecConfig(planner="fixed", sps_online=True)
    spec = build_speculation(SpecConfig(planner="dspark", sps=LADDER, sps_online=True))
    assert spec is not None and spec.measured is not None
    for _ in range(5):
        spec.observe_round(100, 20e-3)  # rounds of 100 tokens at twice the ladder's 10 ms
    assert isinstance(spec.planner, DSparkPlanner)
    assert spec.planner.sps.step_time(100) == pytest.approx(20e-3)  # count 128: 9.5 ms x 20/9.5
    assert spec.planner.sps.step_time(64) == pytest.approx(9e-3)  # too few samples at 64
    plain = build_speculation(SpecConfig(planner="dspark", sps=LADDER))
    assert plain is not None and plain.measured is None
    plain.observe_round(100, 1.0)
    assert isinstance(plain.planner, DSparkPlanner) and plain.planner.sps is LADDER


@pytest.mark.parametrize("staircase", [False, True])
def test_vectorised_step_times_read_the_curve_as_step_time_does(staircase: bool) -> None:
    import torch

    from deepinfer_kit.spec.walk import step_times

    rng = random.Random(7)
    for _ in range(50):
        n = rng.randint(1, 12)
        xs = sorted(rng.sample(range(1, 200), n))
        times, t = [], rng.uniform(0.5, 2.0)
        for _ in xs:
            t += rng.choice([0.0, rng.random()])
            times.append(t)
        curve = SpsCurve(xs, [1.0 / t for t in times], staircase=staircase)
        counts = list(range(0, 260))
        got = step_times(curve, torch.tensor(counts)).tolist()
        assert got == pytest.approx([curve.step_time(b) for b in counts], rel=1e-12)


def test_the_python_and_tensor_walks_agree() -> None:
    from deepinfer_kit.spec.walk import Walk

    rng = random.Random(3)
    for _ in range(300):
        num_req, gamma = rng.randint(1, 12), rng.randint(1, 8)
        conf = [[rng.choice([rng.random(), 1.0, 0.0, 0.5]) for _ in range(rng.randint(0, gamma))]
                for _ in range(num_req)]
        max_lengths = [rng.randint(0, gamma) for _ in range(num_req)]
        other = rng.choice([0, rng.randint(1, 20)])
        top = num_req * (gamma + 1) + other
        curve = random_staircase(rng, rng.randint(1, top), top) if top > 1 and rng.random() < 0.5 \
            else _random_linear(rng, top + 1)
        py, vec = Walk(conf, max_lengths, vectorise=False), Walk(conf, max_lengths, vectorise=True)
        assert list(py.survival) == pytest.approx(vec.survival.tolist(), rel=1e-12)  # type: ignore[union-attr]
        assert list(py.rows) == vec.rows.tolist()  # type: ignore[union-attr]
        for stop in (False, True):
            k = py.best(curve, other, early_stop=stop)
            assert k == vec.best(curve, other, early_stop=stop)
            assert py.lengths(k) == vec.lengths(k)
