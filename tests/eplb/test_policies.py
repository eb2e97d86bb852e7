"""Placement policies: DeepSeek's README example, the contract suite, invariants over seeded cases."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from deepinfer_kit.eplb import (
    ForecastPlacementPolicy,
    GlobalPlacementPolicy,
    HierarchicalPlacementPolicy,
    MovementAwarePlacementPolicy,
    PeakPlacementPolicy,
    Placement,
    PlacementPolicy,
    RefinedPlacementPolicy,
    Topology,
)
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.testing.eplb import PLACEMENT_POLICY_SUITE

POLICIES: dict[str, Callable[[], PlacementPolicy]] = {
    "deepseek_hierarchical": HierarchicalPlacementPolicy,
    "deepseek_global": GlobalPlacementPolicy,
    "refined_hierarchical": lambda: RefinedPlacementPolicy("hierarchical"),
    "refined_global": lambda: RefinedPlacementPolicy("global"),
    "forecast": lambda: ForecastPlacementPolicy(RefinedPlacementPolicy("global"), decay=0.5),
    "movement": lambda: MovementAwarePlacementPolicy(RefinedPlacementPolicy("hierarchical"), expert_bytes=10),
    "peak_hierarchical": PeakPlacementPolicy,
    "peak_global": lambda: PeakPlacementPolicy("global"),
    "peak_hierarchical_even_tokens": lambda: PeakPlacementPolicy("hierarchical", dispatch="even", weighting="tokens"),
    "peak_movement": lambda: MovementAwarePlacementPolicy(PeakPlacementPolicy(), expert_bytes=10, tolerance=0.01),
}

# deepseek-ai/EPLB README: 2 layers x 12 experts, 16 replicas, 4 groups, 2 nodes, 8 GPUs.
README_WEIGHT = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                              [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
README_PHY2LOG = torch.tensor([[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                               [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]])


@pytest.mark.parametrize("spread", [False, True])
def test_deepseek_readme_example_exactly(spread: bool) -> None:
    placement = HierarchicalPlacementPolicy(spread=spread).place(README_WEIGHT[None], Topology(16, 4, 2, 8))
    assert torch.equal(placement.phy2log, README_PHY2LOG)
    assert placement.logcnt.tolist() == [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1],
                                         [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]
    check_invariants(placement, README_WEIGHT, Topology(16, 4, 2, 8))


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("check", PLACEMENT_POLICY_SUITE.checks, ids=PLACEMENT_POLICY_SUITE.ids)
def test_conformance(name: str, check: Callable[[Callable[[], PlacementPolicy]], None]) -> None:
    check(POLICIES[name])


def check_invariants(placement: Placement, load: torch.Tensor, topology: Topology, local: bool = True) -> None:
    """``load``: ``[L, E]`` or ``[S, L, E]``. ``local``: replicas stay in their node, so two
    on one GPU are allowed only beyond the node's GPUs."""
    layers, experts = load.shape[-2:]
    slots, gpus = topology.num_physical_experts, topology.num_gpus
    phy2log, log2phy, logcnt = placement.phy2log, placement.log2phy, placement.logcnt
    assert tuple(phy2log.shape) == (layers, slots) and tuple(logcnt.shape) == (layers, experts)
    assert bool((logcnt >= 1).all()), "an expert without a replica"
    assert logcnt.sum(1).tolist() == [slots] * layers
    for layer in range(layers):
        counted = torch.bincount(phy2log[layer], minlength=experts)
        assert torch.equal(counted, logcnt[layer])
        for e in range(experts):
            held = log2phy[layer, e]
            real = held[: int(logcnt[layer, e])]
            assert bool((held[int(logcnt[layer, e]):] == -1).all())
            assert bool((phy2log[layer, real] == e).all()), "log2phy and phy2log disagree"
            assert len(set(real.tolist())) == len(real)
        per_gpu = phy2log[layer].view(gpus, -1)  # equal slots per GPU by construction of the view
        reach = gpus // topology.num_nodes if local and topology.num_groups % topology.num_nodes == 0 else gpus
        for g in range(gpus):
            ids = per_gpu[g].tolist()
            for e in set(ids):
                if ids.count(e) > 1:
                    assert int(logcnt[layer, e]) > reach, f"layer {layer}: expert {e} twice on GPU {g}"


def _random_case(seed: int) -> tuple[torch.Tensor, Topology]:
    rng = random.Random(seed)
    nodes = rng.choice([1, 2, 4])
    gpus = nodes * rng.choice([1, 2, 4])
    groups = nodes * rng.choice([1, 2])
    experts = groups * rng.choice([2, 4, 8])
    per_gpu = -(-experts // gpus) + rng.choice([0, 1, 2])
    gen = torch.Generator().manual_seed(seed)
    shape = (rng.choice([1, 4]), rng.choice([1, 3]), experts)  # [S, L, E]
    kind = rng.choice(["zipf", "uniform", "zeros", "equal"])
    if kind == "zipf":
        load = (1000.0 / torch.arange(1, experts + 1)[torch.randperm(experts, generator=gen)] ** 1.2).expand(shape)
        load = load * torch.rand(shape[0], 1, experts, generator=gen).add_(0.5)  # steps differ
        load = torch.poisson(load.contiguous(), generator=gen).to(torch.int64)
    elif kind == "uniform":
        load = torch.randint(0, 100, shape, generator=gen)
    elif kind == "zeros":
        load = torch.zeros(shape, dtype=torch.int64)
    else:
        load = torch.full(shape, 7, dtype=torch.int64)
    return load, Topology(per_gpu * gpus, groups, nodes, gpus)


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("seed", range(30))
def test_invariants_on_random_topologies(name: str, seed: int) -> None:
    load, topology = _random_case(seed)
    policy = POLICIES[name]()
    for _ in range(2):  # twice: stateful policies plan from their history the second time
        check_invariants(policy.place(load, topology), load, topology, local="hierarchical" in name or "movement" in name)


@pytest.mark.parametrize("name", POLICIES)
def test_hottest_expert_gets_most_replicas_and_equal_loads_one_each(name: str) -> None:
    load = torch.tensor([[[500, 10, 10, 10, 10, 10, 10, 10]]])
    placement = POLICIES[name]().place(load, Topology(12, 1, 1, 4))
    assert int(placement.logcnt[0, 0]) == int(placement.logcnt.max()) == 5
    equal = torch.full((3, 2, 8), 3)
    assert bool((POLICIES[name]().place(equal, Topology(8, 2, 1, 4)).logcnt == 1).all())


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize(
    ("topology", "field"),
    [
        (Topology(6, 1, 1, 1), "num_physical_experts must be >= the 8 experts"),
        (Topology(10, 1, 1, 4), "num_physical_experts must be divisible by num_gpus=4"),
        (Topology(12, 2, 4, 6), "num_gpus must be divisible by num_nodes=4"),
    ],
)
def test_indivisible_topologies_are_rejected_naming_the_field(name: str, topology: Topology, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        POLICIES[name]().place(torch.ones(1, 2, 8), topology)


def test_hierarchical_needs_groups_dividing_the_experts() -> None:
    with pytest.raises(ConfigError, match="num_groups must divide the 8 experts, got 3"):
        HierarchicalPlacementPolicy().place(torch.ones(1, 1, 8), Topology(12, 3, 1, 4))
    with pytest.raises(ConfigError, match="load must be >= 0"):
        GlobalPlacementPolicy().place(-torch.ones(1, 1, 8), Topology(8, 1, 1, 4))


def test_spread_repairs_two_replicas_on_one_gpu() -> None:
    # 2 packs of 4: the greedy packer puts both replicas of expert 2 on GPU 1.
    load = torch.tensor([[[27, 3, 97, 83, 1, 66]]])
    topology = Topology(8, 1, 1, 2)
    raw = GlobalPlacementPolicy(spread=False).place(load, topology)
    fixed = GlobalPlacementPolicy().place(load, topology)
    check_invariants(fixed, load, topology)
    assert raw.phy2log[0].view(2, 4).tolist() == [[5, 3, 0, 1], [2, 2, 3, 4]]
