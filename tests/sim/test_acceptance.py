"""The synthetic acceptance model: calibrated confidences (and a miscalibrated variant
that fails the same check), accepted lengths that follow the product of the per-depth
probabilities, seeded reproducibility, validation."""

from __future__ import annotations

import math

import pytest

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sim.acceptance import AcceptanceModel

GAMMA = 6


def _draws(model: AcceptanceModel, n_req: int = 150, n_pos: int = 16) -> list[tuple[float, bool]]:
    return [
        (model.reported(f"r{r}", q, j), model.draft_is_right(f"r{r}", q, j))
        for r in range(n_req) for q in range(0, 4 * n_pos, 4) for j in range(GAMMA)
    ]


def _worst_bin_z(draws: list[tuple[float, bool]]) -> float:
    """Largest |observed - predicted| / binomial std over 10 confidence bins."""
    bins: dict[int, list[tuple[float, bool]]] = {}
    for c, ok in draws:
        bins.setdefault(min(9, int(c * 10)), []).append((c, ok))
    worst = 0.0
    for rows in bins.values():
        if len(rows) < 200:
            continue
        diff = sum(ok - c for c, ok in rows)
        var = sum(c * (1 - c) for c, _ in rows)
        worst = max(worst, abs(diff) / math.sqrt(var))
    return worst


def test_confidence_is_calibrated_and_an_overconfident_one_is_not() -> None:
    draws = _draws(AcceptanceModel(seed=1))
    assert len({min(9, int(c * 10)) for c, _ in draws}) >= 6  # the confidences spread
    assert _worst_bin_z(draws) < 4.0
    assert _worst_bin_z(_draws(AcceptanceModel(seed=1, confidence_power=0.3))) > 10.0
    assert _worst_bin_z(_draws(AcceptanceModel(seed=1, confidence_power=2.0))) > 10.0


def test_true_probability_is_centred_on_the_confidence() -> None:
    m = AcceptanceModel(seed=2, noise=1.0)
    rows = [(m.confidence(f"r{r}", q, j), m.true_probability(f"r{r}", q, j))
            for r in range(100) for q in range(30) for j in range(GAMMA)]
    assert all(0.0 <= p <= 1.0 for _, p in rows)
    assert any(abs(p - c) > 0.05 for c, p in rows)  # noisy per draft ...
    mean_gap = sum(p - c for c, p in rows) / len(rows)
    assert abs(mean_gap) < 0.005  # ... right on average


def test_accepted_length_follows_the_product_of_probabilities() -> None:
    m = AcceptanceModel(seed=3)
    rounds = [(f"r{r}", q) for r in range(200) for q in range(0, 45, 3)]
    for rid, q in rounds[:200]:  # structurally: the drafts before the first wrong one
        L = m.accepted_length(rid, q, GAMMA)
        assert all(m.draft_is_right(rid, q, j) for j in range(L))
        assert L == GAMMA or not m.draft_is_right(rid, q, L)
        assert m.accepted_length(rid, q, 2) == min(L, 2)
    for k in range(1, GAMMA + 1):  # statistically: P(L >= k) = E[prod_{j<k} p_j]
        hits = sum(m.accepted_length(rid, q, GAMMA) >= k for rid, q in rounds)
        probs = [math.prod(m.true_probability(rid, q, j) for j in range(k)) for rid, q in rounds]
        survival = [math.prod(m.reported(rid, q, j) for j in range(k)) for rid, q in rounds]
        var = sum(p * (1 - p) for p in probs)
        assert abs(hits - sum(probs)) < 4 * math.sqrt(var) + 1, k
        assert abs(hits - sum(survival)) < 4 * math.sqrt(var) + 1, k  # calibrated survival


def test_seeded_reproducible_and_batch_independent() -> None:
    a, b, other = AcceptanceModel(seed=7), AcceptanceModel(seed=7), AcceptanceModel(seed=8)
    keys = [(f"x{r}", q, j) for r in range(20) for q in range(10) for j in range(4)]
    seen = [(a.reported(*k), a.draft_is_right(*k)) for k in keys]
    assert seen == [(b.reported(*k), b.draft_is_right(*k)) for k in reversed(keys)][::-1]
    a.forget("x3")
    assert seen == [(a.reported(*k), a.draft_is_right(*k)) for k in keys]
    assert seen != [(other.reported(*k), other.draft_is_right(*k)) for k in keys]
    # the draw for a depth does not depend on the round's other depths
    assert a.draft_is_right("x1", 5, 2) == AcceptanceModel(seed=7).draft_is_right("x1", 5, 2)


@pytest.mark.parametrize("field, value", [
    ("difficulty_alpha", 0.0), ("difficulty_beta", -1.0), ("token_spread", 1.5),
    ("decay", 0.0), ("noise", -0.1), ("confidence_power", float("inf")),
])
def test_bad_fields_name_themselves(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"acceptance.{field}"):
        AcceptanceModel(**{field: value})
