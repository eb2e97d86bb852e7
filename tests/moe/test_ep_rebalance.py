"""plan_transfers: the rank-to-rank copy plan every rank computes alike for a new slot map."""

from __future__ import annotations

import random

import pytest

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.moe.ep_rebalance import plan_transfers


@pytest.mark.parametrize("seed", range(10))
def test_every_changed_slot_gets_its_expert_preferring_its_own_rank(seed: int) -> None:
    rng = random.Random(seed)
    world, experts = rng.choice([1, 2, 4]), rng.randint(2, 8)
    slots = experts + world * rng.randint(0, 2)
    slots += -slots % world
    old = list(range(experts)) + [rng.randrange(experts) for _ in range(slots - experts)]
    new = old[:]
    rng.shuffle(old)
    rng.shuffle(new)
    per = slots // world
    plan = plan_transfers(old, new, world)
    assert [dst for _, dst in plan] == [s for s in range(slots) if old[s] != new[s]]
    for src, dst in plan:
        assert old[src] == new[dst]
        on_my_rank = [s for s in range(slots) if old[s] == new[dst] and s // per == dst // per]
        assert (src // per == dst // per) == bool(on_my_rank)
    assert plan == plan_transfers(old, new, world)


def test_a_hot_expert_is_sent_from_each_of_its_holders_in_turn() -> None:
    old = [0, 0, 1, 2, 3, 4, 5, 6]  # 2 ranks of 4 slots; expert 0 twice on rank 0
    new = [1, 2, 3, 4, 0, 0, 5, 6]  # ... moves to rank 1
    plan = plan_transfers(old, new, 2)
    assert plan == [(2, 0), (3, 1), (4, 2), (5, 3), (0, 4), (1, 5)]


def test_maps_that_differ_in_experts_or_shape_are_refused() -> None:
    with pytest.raises(ConfigError, match="new phy2log must hold the same experts"):
        plan_transfers([0, 1, 2, 2], [0, 1, 1, 1], 2)
    with pytest.raises(ConfigError, match="one length divisible by 2, got 3 and 3"):
        plan_transfers([0, 1, 2], [2, 1, 0], 2)
