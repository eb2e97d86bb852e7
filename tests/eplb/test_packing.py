"""Packing and placement helpers against pure-Python references, and plans pinned to the
results of the earlier per-item tensor implementation (the fast paths must not change a
single placement)."""

from __future__ import annotations

import hashlib
import random

import pytest
import torch

from deepinfer_kit.eplb import (
    GlobalPlacementPolicy,
    HierarchicalPlacementPolicy,
    PlacementPolicy,
    RefinedPlacementPolicy,
    Topology,
    greedy_pack,
    placement_from_phy2log,
)
from deepinfer_kit.testing.eplb_traces import drifting_zipf_trace


def reference_greedy_pack(weight: list[float], num_packs: int) -> tuple[list[int], list[int]]:
    """DeepSeek's balanced packing, item by item: heaviest first, to the lightest non-full
    pack (lowest index on ties); loads are float64 sums of the float32 weights."""
    n = len(weight)
    cap = n // num_packs
    if cap == 1:
        return list(range(n)), [0] * n
    order = sorted(range(n), key=lambda i: -weight[i])  # stable: equal weights keep index order
    load, count = [0.0] * num_packs, [0] * num_packs
    pack, rank = [0] * n, [0] * n
    for i in order:
        p = min((q for q in range(num_packs) if count[q] < cap), key=lambda q: (load[q], q))
        pack[i], rank[i] = p, count[p]
        load[p] += weight[i]
        count[p] += 1
    return pack, rank


def _weights(seed: int) -> tuple[torch.Tensor, int]:
    rng = random.Random(seed)
    packs = rng.choice([1, 2, 3, 4, 8])
    n = packs * rng.choice([1, 2, 3, 9])
    rows = rng.choice([1, 3])
    gen = torch.Generator().manual_seed(seed)
    kind = rng.choice(["ties", "float", "zeros", "sparse"])
    if kind == "ties":  # many equal weights: the tie rules decide
        return torch.randint(0, 4, (rows, n), generator=gen), packs
    if kind == "float":
        return torch.rand(rows, n, generator=gen, dtype=torch.float64) * 100, packs
    if kind == "zeros":
        return torch.zeros(rows, n, dtype=torch.int64), packs
    return torch.randint(0, 1000, (rows, n), generator=gen) * (torch.rand(rows, n, generator=gen) < 0.3), packs


@pytest.mark.parametrize("seed", range(60))
def test_greedy_pack_equals_the_item_by_item_reference(seed: int) -> None:
    weight, packs = _weights(seed)
    pack, rank = greedy_pack(weight, packs)
    for r, row in enumerate(weight.float().double().tolist()):
        want_pack, want_rank = reference_greedy_pack(row, packs)
        assert pack[r].tolist() == want_pack, f"seed {seed} row {r}"
        assert rank[r].tolist() == want_rank, f"seed {seed} row {r}"


@pytest.mark.parametrize("seed", range(10))
def test_placement_from_phy2log_ranks_replicas_in_slot_order(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    experts = 6
    phy2log = torch.cat([torch.arange(experts), torch.randint(0, experts, (10,), generator=gen)])
    phy2log = torch.stack([phy2log[torch.randperm(16, generator=gen)] for _ in range(3)])
    placement = placement_from_phy2log(phy2log, experts)
    for layer, row in enumerate(phy2log.tolist()):
        seen = [0] * experts
        for slot, e in enumerate(row):
            assert int(placement.log2phy[layer, e, seen[e]]) == slot
            seen[e] += 1
        assert placement.logcnt[layer].tolist() == seen


# Produced by the implementation before the planning speed-up (per-item tensor loops).
PINNED_SMALL = {
    ("hierarchical", 0): [[11, 11, 8, 3, 10, 9, 11, 11, 8, 2, 1, 0, 15, 15, 13, 5, 12, 6, 15, 7, 14, 13, 12, 4],
                          [2, 14, 14, 0, 12, 3, 14, 14, 14, 1, 15, 13, 9, 5, 5, 6, 7, 4, 9, 5, 10, 6, 11, 8]],
    ("global", 0): [[11, 11, 7, 5, 2, 10, 11, 12, 15, 13, 4, 6, 11, 15, 8, 14, 13, 9, 11, 15, 8, 3, 1, 0],
                    [2, 9, 5, 6, 12, 3, 14, 14, 5, 1, 0, 4, 14, 14, 10, 6, 11, 13, 14, 9, 5, 7, 15, 8]],
    ("hierarchical", 1): [[9, 9, 8, 13, 15, 14, 9, 9, 8, 11, 10, 12, 2, 5, 3, 0, 4, 7, 6, 5, 5, 3, 0, 1],
                          [8, 8, 8, 3, 0, 1, 8, 8, 2, 11, 9, 10, 13, 15, 15, 5, 4, 14, 13, 15, 12, 5, 6, 7]],
    ("global", 1): [[3, 5, 8, 13, 10, 14, 9, 9, 8, 13, 15, 4, 9, 9, 0, 6, 11, 1, 9, 5, 8, 2, 12, 7],
                    [8, 8, 2, 5, 9, 14, 8, 12, 15, 5, 10, 1, 8, 13, 15, 11, 6, 0, 8, 15, 13, 3, 4, 7]],
}
# sha256 (first 16 hex digits) of str(phy2log.tolist()) and str(log2phy.tolist()) at the
# benchmark's shape: L=8, E=256, 288 slots, 8 groups, 4 nodes, 32 GPUs.
PINNED_DIGESTS = {
    "deepseek_hierarchical": ("b18b4894e67ef023", "11d1b0e19658e8fb"),
    "deepseek_global": ("c227f1a1174db71d", "5ffdffbe641d5066"),
    "refined_hierarchical": ("986a62ce265ba01c", "3852b4f8552342cc"),
    "refined_global": ("a6f71aade71cc55f", "ae19cbda80a88fe9"),
}


@pytest.mark.parametrize(("mode", "seed"), list(PINNED_SMALL))
def test_refined_plans_are_pinned_on_a_small_topology(mode: str, seed: int) -> None:
    load = drifting_zipf_trace(1, 2, 16, exponent=1.0, tokens_per_window=4096, seed=seed)[0]
    placement = RefinedPlacementPolicy(mode).place(load[None], Topology(24, 4, 2, 4))  # type: ignore[arg-type]
    assert placement.phy2log.tolist() == PINNED_SMALL[(mode, seed)]


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(str(t.tolist()).encode()).hexdigest()[:16]


def test_plans_are_pinned_at_the_benchmark_shape() -> None:
    load = drifting_zipf_trace(1, 8, 256, exponent=0.8, tokens_per_window=1 << 17, seed=0)[0]
    topology = Topology(288, 8, 4, 32)
    policies: dict[str, PlacementPolicy] = {
        "deepseek_hierarchical": HierarchicalPlacementPolicy(),
        "deepseek_global": GlobalPlacementPolicy(),
        "refined_hierarchical": RefinedPlacementPolicy("hierarchical"),
        "refined_global": RefinedPlacementPolicy("global"),
    }
    for name, policy in policies.items():
        placement = policy.place(load[None], topology)
        assert (_digest(placement.phy2log), _digest(placement.log2phy)) == PINNED_DIGESTS[name], name
