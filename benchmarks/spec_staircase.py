"""The planner study on step-shaped (staircase) costs, beside DeepInfer's rule
(``bench_spec_planners.py --staircase``).

Part 1, the rule: the same inputs to each planner — random staircases (8-32 captured sizes,
16-256 rows, γ <= 8), this round's confidences and the previous round's (this round's plus
noise: what a planner that must not peek sizes the round with), half of the rounds with a
prefill beside the verified chunks — scored by ``Θ = τ / t`` of this round's confidences
against the optimum over prefix-closed selections (which only a planner reading every
confidence of this round could reach: an upper bound, not an exact rule). Rows: the kit's
whole walk from the previous round's budget (the engine's rule), the kit's early stop on
this round's confidences, DeepInfer's ``MTPVarlen::schedule`` (previous round's rates for
the total, this round's for the split; its curve has no term for prefill), and the kit's
whole walk on this round's confidences (peeking, not exact: the bound). Plus the time of
one call.

Part 2, serving: the closed-loop simulator of ``bench_spec_planners.py`` with rounds padded
to captured sizes (``PaddedCost`` over the H200 roofline), the planners fed the staircase
the engine would profile (``ladder_sps``).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence

from deepinfer_kit.sim import H200, QWEN3_1_7B
from deepinfer_kit.sim.cost_padded import PaddedCost, ladder_sps
from deepinfer_kit.sim.cost_saturating import SaturatingCost
from deepinfer_kit.spec.planners import DSparkPlanner, survival
from deepinfer_kit.spec.records import SpsCurve

CAPTURED = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class EarlyStop:
    """The DSpark planner's early stop alone (no budget: :class:`RoundPlanner` calls ``plan``)."""

    def __init__(self, sps: SpsCurve) -> None:
        self.inner = DSparkPlanner(sps)

    def plan(self, confidence: Sequence[Sequence[float]], max_lengths: Sequence[int],
             other_tokens: int = 0) -> list[int]:
        return self.inner.plan(confidence, max_lengths, other_tokens)


class DeepInferPlanner:
    """DeepInfer's rule as a budgeted verify planner: the previous round's survivals size the
    round, this round's split it (its ``seqlens_q`` minus the base token)."""

    def __init__(self, schedule: Callable[..., list[int]], sps: SpsCurve) -> None:
        self.schedule = schedule
        self.curve = [(b, 1e3 / s) for b, s in zip(sps.batch_tokens, sps.steps_per_second)]

    def plan(self, confidence: Sequence[Sequence[float]], max_lengths: Sequence[int],
             other_tokens: int = 0) -> list[int]:
        return self.plan_budgeted(confidence, max_lengths, other_tokens, confidence)

    def plan_budgeted(self, confidence: Sequence[Sequence[float]], max_lengths: Sequence[int],
                      other_tokens: int, budget_confidence: Sequence[Sequence[float]]) -> list[int]:
        rates = [survival(c, m) + [0.0] * (m - len(survival(c, m))) for c, m in zip(confidence, max_lengths)]
        prev = [survival(c, m) + [0.0] * (m - len(survival(c, m))) for c, m in zip(budget_confidence, max_lengths)]
        return [min(m, q - 1) for q, m in zip(self.schedule(self.curve, rates, prev), max_lengths)]


def random_staircase(rng: random.Random, steps: int, top: int) -> SpsCurve:
    """``steps`` captured sizes up to ``top`` with non-decreasing times (flat stretches,
    small and large steps)."""
    sizes = sorted(rng.sample(range(1, top), steps - 1)) + [top]
    times, t = [], rng.uniform(1e-3, 1e-2)
    for _ in sizes:
        t += rng.choice([0.0, rng.uniform(0.0, 2e-3), rng.uniform(0.0, 2e-2)])
        times.append(t)
    return SpsCurve.ladder(sizes, times)


def theta(conf: Sequence[Sequence[float]], lengths: Sequence[int], curve: SpsCurve, other: int) -> float:
    """``Θ`` of verifying ``lengths`` with ``other`` prefill tokens in the round."""
    num_req = len(conf)
    tau = num_req + sum(sum(survival(c, n)) for c, n in zip(conf, lengths))
    prefill_s = curve.step_time(num_req + other) - curve.step_time(num_req)
    return tau / (curve.step_time(num_req + other + sum(lengths)) - prefill_s)


def rule_rows(cases: int, seed: int, schedule: Callable[..., list[int]] | None) -> None:
    """Part 1 (module docstring): prints one row per rule."""
    rng = random.Random(seed)
    scores: dict[str, list[float]] = {}
    spent: dict[str, float] = {}
    for _ in range(cases):
        num_req, gamma = rng.randint(16, 256), rng.randint(1, 8)
        mean = rng.random()
        conf = [[min(1.0, max(0.0, rng.gauss(mean, 0.25))) for _ in range(gamma)] for _ in range(num_req)]
        prev = [[min(1.0, max(0.0, c + rng.gauss(0.0, 0.1))) for c in row] for row in conf]
        other = rng.choice([0, rng.randint(1, 4 * num_req)])
        top = num_req * (gamma + 1) + other
        curve = random_staircase(rng, rng.randint(8, 32), top + rng.randint(0, top))
        kit = DSparkPlanner(curve)
        lengths = [gamma] * num_req
        best = theta(conf, kit.plan_budgeted(conf, lengths, other, conf), curve, other)
        rules: dict[str, Callable[[], list[int]]] = {
            "kit: whole walk, previous round's budget": lambda: kit.plan_budgeted(conf, lengths, other, prev),
            "kit: early stop (before)": lambda: kit.plan(conf, lengths, other),
        }
        if schedule is not None:
            peer = DeepInferPlanner(schedule, curve)
            rules["DeepInfer MTPVarlen::schedule"] = lambda: peer.plan_budgeted(conf, lengths, other, prev)
        for name, rule in rules.items():
            t0 = time.perf_counter()
            got = rule()
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
            scores.setdefault(name, []).append(theta(conf, got, curve, other) / best)
            if other == 0:
                scores.setdefault(name + " | no prefill", []).append(theta(conf, got, curve, other) / best)
    print(f"planner rule on {cases} random staircases (Θ over the optimum on this round's confidences;"
          f" half the rounds with prefill)")
    for name, vals in scores.items():
        vals.sort()
        per = spent.get(name)
        tail = f"  {per / cases * 1e6:7.0f} us/call" if per is not None else ""
        print(f"  {name:<52} mean {statistics.fmean(vals):.4f}  p5 {vals[len(vals) // 20]:.4f}  "
              f"min {vals[0]:.4f}  within 1%: {sum(v >= 0.99 for v in vals) / len(vals):6.1%}{tail}")


def padded_cost() -> tuple[PaddedCost, SpsCurve]:
    """The H200 roofline of Qwen3-1.7B with rounds padded to :data:`CAPTURED`, and its staircase."""
    cost = PaddedCost(SaturatingCost.from_shape(QWEN3_1_7B, H200), CAPTURED)
    return cost, ladder_sps(cost)
