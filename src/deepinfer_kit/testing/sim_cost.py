"""Conformance suite for the simulator's CostModel (and, when implemented, its optional
DecodeRoundCost): prices are non-negative, pure and grow with the work; a stretch priced
in one call is the very floats ``step_time`` gives round by round, cut at the same
round."""

from __future__ import annotations

from collections.abc import Callable

from deepinfer_kit.sim.protocols import CostModel, DecodeRoundCost
from deepinfer_kit.sim.records import StepShape
from deepinfer_kit.testing.suite import Suite, expect

__all__ = ["COST_MODEL_SUITE", "CostFactory"]

CostFactory = Callable[[], CostModel]
"""``factory()``: a fresh cost model."""

COST_MODEL_SUITE: Suite[CostFactory] = Suite("CostModel", "factory() -> CostModel")

_SHAPES = [
    StepShape(0, 1, 17, 1, 17, 1),
    StepShape(0, 64, 64 * 900, 64, 64 * 900, 64),
    StepShape(512, 0, 512, 1, 512 * 513 // 2, 1),
    StepShape(2048, 30, 9000, 31, 2_500_000, 31),
    StepShape(0, 8, 4000, 8, 4000, 8, 24),
]


def _decode(n: int, context: int) -> StepShape:
    return StepShape(0, n, context, n, context, n, 0)


@COST_MODEL_SUITE.check
def check_prices_are_pure_and_non_negative(factory: CostFactory) -> None:
    cost = factory()
    for shape in _SHAPES:
        first, second = cost.step_time(shape), cost.step_time(shape)
        expect(first == second, f"step_time({shape}) gave {first}, then {second}")
        expect(first >= 0, f"step_time({shape}) = {first} < 0")


@COST_MODEL_SUITE.check
def check_more_work_never_costs_less(factory: CostFactory) -> None:
    cost = factory()
    for n, context in ((1, 10), (16, 4000), (128, 50_000)):
        base = cost.step_time(_decode(n, context))
        more = (_decode(n, context * 2), _decode(n * 2, context * 2),
                StepShape(0, n, context, n, context, n, n))
        for shape in more:
            expect(cost.step_time(shape) >= base,
                   f"{shape} priced {cost.step_time(shape)} below {base} for {_decode(n, context)}")


@COST_MODEL_SUITE.check
def check_round_times_are_step_times(factory: CostFactory) -> None:
    """A :class:`DecodeRoundCost` prices round ``r`` of a stretch at exactly
    ``step_time`` of its shape (context ``+ r * n``), and stops before the round that
    would start at or after ``until`` (the first is always priced)."""
    cost = factory()
    if not isinstance(cost, DecodeRoundCost):
        return  # optional: the simulator prices such a cost model round by round
    for n, context, until, cap in ((1, 17, 1e9, 300), (5, 2604, 0.05, 4096), (64, 90000, 1e9, 50),
                                   (3, 9, 0.0, 10), (7, 700, 1.5e-3, 4096)):
        got = cost.decode_round_times(n, context, 0.25, 0.25 + until, cap)
        want: list[float] = []
        now = 0.25
        while len(want) < cap and (not want or now < 0.25 + until):
            d = cost.step_time(_decode(n, context + len(want) * n))
            want.append(d)
            now += d
        expect(got == want, f"decode_round_times({n}, {context}, until +{until}, {cap}): "
                            f"{len(got)} rounds {got[:3]}..., step_time gives {len(want)} {want[:3]}...")
