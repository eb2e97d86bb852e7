"""The balancer's device steps (moe/selector_tables.py) against a plain-Python reference of
the same method, on random slot maps: water-filling shares, their rounding, the tables'
rebuild when the layout changes."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer_kit.moe import selector_tables
from deepinfer_kit.moe.replica_layout import ReplicaLayout
from deepinfer_kit.moe.selectors import BalancedSelector, gpu_load_of


def _reference_shares(total: list[int], layout: ReplicaLayout, sweeps: int) -> dict[int, list[float]]:
    """Block-coordinate water-filling in plain Python: expert -> share per replica."""
    per_gpu = layout.num_slots // layout.num_gpus
    slots = {e: [s for s, x in enumerate(layout.phy2log.tolist()) if x == e] for e in range(layout.num_experts)}
    load = [0.0] * layout.num_gpus
    hot = []
    for e, where in slots.items():
        if len(where) == 1:
            load[where[0] // per_gpu] += total[e]
        else:
            hot.append(e)
    hot.sort(key=lambda e: -total[e])  # hottest first; sort is stable
    share = {e: [0.0] * len(slots[e]) for e in hot}
    for _ in range(sweeps if len(hot) > 1 else 1):
        for e in hot:
            gpus = [s // per_gpu for s in slots[e]]
            first = [gpus.index(g) == r for r, g in enumerate(gpus)]  # a second replica on a GPU gets 0
            for r, g in enumerate(gpus):
                load[g] -= share[e][r]
            levels = sorted(load[g] for r, g in enumerate(gpus) if first[r])
            h = min((total[e] + sum(levels[:k])) / k for k in range(1, len(levels) + 1))
            share[e] = [max(h - load[g], 0.0) if first[r] else 0.0 for r, g in enumerate(gpus)]
            for r, g in enumerate(gpus):
                load[g] += share[e][r]
    return share


def _random_case(seed: int) -> tuple[ReplicaLayout, torch.Tensor]:
    rng = random.Random(seed)
    experts = rng.choice([4, 8, 16])
    extra = rng.randint(0, experts)
    gpus = rng.choice([g for g in (1, 2, 3, 4, 6, 8) if (experts + extra) % g == 0])
    phy2log = list(range(experts)) + [rng.randrange(min(3, experts)) if rng.random() < 0.5 else rng.randrange(experts)
                                      for _ in range(extra)]
    rng.shuffle(phy2log)
    total = torch.tensor([rng.choice([0, 1, 3, 17, 200]) for _ in range(experts)])
    return ReplicaLayout(phy2log, experts, gpus), total


@pytest.mark.parametrize("path", ["subsets", "sort"])
@pytest.mark.parametrize("sweeps", [1, 2, 3])
def test_water_filling_matches_the_python_reference(sweeps: int, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways of taking the water level: over GPU subsets (every case here reaches at
    most 6 replica positions) and by sorting the loads (forced)."""
    if path == "sort":
        monkeypatch.setattr(selector_tables, "SUBSET_REACH", 0)
    for seed in range(60):
        layout, total = _random_case(seed)
        got, loads = BalancedSelector(sweeps).shares(total, layout)
        want = _reference_shares(total.tolist(), layout, sweeps)
        hot = layout.spread[: layout.num_spread].tolist()
        assert got.shape == (len(hot), layout.width), seed
        for row, e in zip(got, hot):
            ref = want[e] + [0.0] * (layout.width - len(want[e]))
            torch.testing.assert_close(row, torch.tensor(ref, dtype=torch.float64), rtol=0, atol=1e-9)
        assert torch.isclose(loads.sum(), total.double().sum()), seed
        assert (selector_tables.SelectorTables(layout).subsets is None) == (path == "sort" and layout.num_spread > 0) \
            or layout.num_spread == 0


def test_rounded_quotas_stay_within_one_copy_of_the_shares_and_sum_to_the_totals() -> None:
    for seed in range(60):
        layout, total = _random_case(seed)
        selector = BalancedSelector()
        quotas = selector.quotas(total, layout)
        shares, _ = selector.shares(total, layout)
        hot = layout.spread[: layout.num_spread].tolist()
        for row, e in zip(shares, hot):
            slots = layout.log2phy[e, : int(layout.logcnt[e])]
            assert bool((quotas[slots].double() - row[: slots.numel()]).abs().max() < 1), seed
        per_expert = torch.zeros(layout.num_experts, dtype=torch.int64).index_add_(0, layout.phy2log, quotas)
        assert torch.equal(per_expert, total), seed
        assert int(gpu_load_of(quotas, layout).sum()) == int(total.sum())


def test_a_selector_follows_a_new_layout() -> None:
    """The tables are cached per layout: a new layout (a rebalance) must rebuild them."""
    selector = BalancedSelector()
    total = torch.tensor([40, 1, 2, 3, 4, 5, 6, 7])
    first = ReplicaLayout([0, 1, 2, 0, 3, 4, 0, 5, 6, 0, 7, 0], 8, 4)
    second = ReplicaLayout([1, 0, 2, 1, 3, 4, 1, 5, 6, 1, 7, 1], 8, 4)
    selector.quotas(total, first)
    got = selector.quotas(total, second)
    assert torch.equal(got, BalancedSelector().quotas(total, second))
    assert int(got[second.log2phy[0, 0]]) == 40  # expert 0 has one slot under the second map
