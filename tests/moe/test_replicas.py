"""Physical expert slots: the replica table routes every copy to a slot of its expert,
weights move to a new map intact, and a layer with replicas computes what it did without."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from moe_layers import make_layer, no_host_reads

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.moe.replicas import ReplicaTable, move_slots


def _random_map(rng: random.Random, experts: int, slots: int) -> list[int]:
    """A slot map holding every expert at least once, the rest random, shuffled."""
    phy2log = list(range(experts)) + [rng.randrange(experts) for _ in range(slots - experts)]
    rng.shuffle(phy2log)
    return phy2log


@pytest.mark.parametrize("seed", range(12))
def test_every_copy_goes_to_a_slot_of_its_expert(seed: int) -> None:
    rng = random.Random(seed)
    experts = rng.randint(1, 9)
    phy2log = _random_map(rng, experts, experts + rng.randint(0, 7))
    table = ReplicaTable(phy2log, experts)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, experts, (rng.randint(0, 30), rng.randint(1, 3)), generator=gen)
    slots = table.physical(ids)
    assert slots.shape == ids.shape
    assert torch.equal(torch.tensor(phy2log, dtype=torch.int64)[slots], ids)
    assert torch.equal(table.physical(ids), slots)  # deterministic
    expert = rng.randrange(experts)
    replicas = phy2log.count(expert)
    spread = table.physical(torch.full((4 * replicas, 1), expert))
    counts = torch.bincount(spread.flatten(), minlength=len(phy2log))
    assert sorted(counts[counts > 0].tolist()) == [4] * replicas  # consecutive copies cycle


@pytest.mark.parametrize("seed", range(12))
def test_moving_slots_puts_every_expert_in_its_new_slot(seed: int) -> None:
    rng = random.Random(seed)
    experts = rng.randint(1, 8)
    slots = experts + rng.randint(0, 6)
    old, new = _random_map(rng, experts, slots), _random_map(rng, experts, slots)
    table = ReplicaTable(old, experts)
    weights = [torch.tensor(old, dtype=torch.float32)[:, None].repeat(1, 3), torch.tensor(old)[:, None, None] * 10]
    moved = move_slots(weights, table.sources(new))
    table.assign(new)
    assert moved == sum(o != n for o, n in zip(old, new))
    assert weights[0][:, 0].tolist() == new and (weights[1][:, 0, 0] // 10).tolist() == new
    assert table.slot_experts == tuple(new) and table.phy2log.tolist() == new
    assert torch.equal(table.logcnt, torch.bincount(torch.tensor(new), minlength=experts))


@pytest.mark.parametrize("seed", range(4))
def test_layer_with_replicas_equals_the_plain_layer(seed: int) -> None:
    plain = make_layer(seed, shared=seed % 2 == 1, impl="ref")
    layer = copy.deepcopy(plain)
    rng = random.Random(seed)
    experts = plain.config.num_experts
    layer.use_replicas(_random_map(rng, experts, experts + 3))
    hidden = torch.randn(23, plain.config.hidden_size, generator=torch.Generator().manual_seed(seed))
    want = plain(hidden)
    for _ in range(3):
        torch.testing.assert_close(layer(hidden), want, rtol=1e-6, atol=1e-6)
        assert torch.equal(layer.last_expert_counts, plain.last_expert_counts)
        assert layer.last_slot_counts is not None and int(layer.last_slot_counts.sum()) == hidden.shape[0] * plain.config.top_k
        layer.apply_placement(_random_map(rng, experts, experts + 3))


@pytest.mark.triton
@pytest.mark.parametrize("seed", range(2))
def test_triton_layer_with_replicas_reads_nothing_back(seed: int) -> None:
    ref = make_layer(seed, shared=False, impl="ref")
    tri = make_layer(seed, shared=False, impl="triton")
    phy2log = _random_map(random.Random(seed), ref.config.num_experts, ref.config.num_experts + 2)
    ref.use_replicas(phy2log)
    tri.use_replicas(phy2log)
    hidden = torch.randn(9, ref.config.hidden_size, generator=torch.Generator().manual_seed(seed))
    with no_host_reads():
        out = tri(hidden)
    torch.testing.assert_close(out, ref(hidden), rtol=1e-4, atol=1e-4)
    assert tri.last_expert_counts is not None and tri.last_slot_counts is not None
    assert torch.equal(tri.last_expert_counts.cpu(), ref.last_expert_counts)
    assert torch.equal(tri.last_slot_counts.cpu(), ref.last_slot_counts)


def test_bad_maps_are_refused_before_anything_moves() -> None:
    layer = make_layer(0, shared=False, impl="ref")
    experts = layer.config.num_experts
    with pytest.raises(ConfigError, match="apply_placement needs physical slots"):
        layer.apply_placement(list(range(experts)))
    with pytest.raises(ConfigError, match=r"phy2log must give every expert a slot, got none for \[1\]"):
        layer.use_replicas([0] + list(range(2, experts)) + [0])
    layer.use_replicas(list(range(experts)) + [0])
    before = layer.experts.gate_up.clone()
    with pytest.raises(ConfigError, match=r"phy2log must hold .* ids in \[0, "):
        layer.apply_placement([0] * experts)
    with pytest.raises(ConfigError, match="phy2log must give every expert a slot"):
        layer.apply_placement([0] * (experts + 1))
    assert torch.equal(layer.experts.gate_up, before)
    with pytest.raises(ConfigError, match="use_replicas needs a layer with a LocalDispatcher and no replicas yet"):
        layer.use_replicas(list(range(experts)))
