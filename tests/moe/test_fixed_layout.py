"""A fixed ReplicaLayout (what a layer's ReplicaTable uses) keeps every tensor it and its
selector tables hold across a new slot map — same storage, new contents — so a CUDA graph
captured before a rebalance reads the new map after it; and its selections equal those of
a layout built from scratch for that map."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer_kit.moe.replica_layout import ReplicaLayout
from deepinfer_kit.moe.selector_tables import tables_of
from deepinfer_kit.moe.selectors import BalancedSelector, EvenSelector, StaticSelector


def _maps(seed: int) -> tuple[int, int, list[list[int]]]:
    rng = random.Random(seed)
    experts = rng.choice([4, 8, 16])
    extra = rng.choice([1, 2, experts // 2, experts])
    gpus = rng.choice([g for g in (1, 2, 4) if (experts + extra) % g == 0])
    maps = []
    for _ in range(4):
        phy2log = list(range(experts)) + [rng.randrange(min(2, experts)) if rng.random() < 0.5
                                          else rng.randrange(experts) for _ in range(extra)]
        rng.shuffle(phy2log)
        maps.append(phy2log)
    return experts, gpus, maps


def _tensors(layout: ReplicaLayout) -> dict[str, torch.Tensor]:
    tables = tables_of(layout)
    found = {f"layout.{k}": v for k, v in vars(layout).items() if isinstance(v, torch.Tensor)}
    found.update({f"tables.{k}": v for k, v in vars(tables).items() if isinstance(v, torch.Tensor)})
    return found


@pytest.mark.parametrize("seed", range(24))
def test_update_rewrites_in_place_and_selects_as_a_fresh_layout(seed: int) -> None:
    experts, gpus, maps = _maps(seed)
    layout = ReplicaLayout(maps[0], experts, gpus, fixed=True)
    before = {k: (v, v.data_ptr(), v.shape) for k, v in _tensors(layout).items()}
    rng = random.Random(seed)
    for phy2log in maps[1:]:
        layout.update(phy2log)
        fresh = ReplicaLayout(phy2log, experts, gpus, fixed=True)
        now, want = _tensors(layout), _tensors(fresh)
        assert now.keys() == want.keys() == before.keys()
        for name, tensor in now.items():
            old, ptr, shape = before[name]
            assert tensor is old and tensor.data_ptr() == ptr and tensor.shape == shape, name
            assert torch.equal(tensor, want[name]), name
        ids = torch.tensor([rng.randrange(experts) for _ in range(rng.randint(1, 60))])
        counts = torch.zeros(experts, dtype=torch.int64).index_add_(0, ids, torch.ones_like(ids))[None]
        plain = ReplicaLayout(phy2log, experts, gpus)  # unfixed: tables sized by the map
        for selector in (StaticSelector(), EvenSelector(), BalancedSelector()):
            got = selector.select(ids, counts, 0, layout)
            assert torch.equal(got.slots, selector.select(ids, counts, 0, fresh).slots), selector.name
            unfixed = selector.select(ids, counts, 0, plain)
            assert torch.equal(layout.phy2log[got.slots], ids)  # every copy on a replica of its expert
            if got.quotas is not None and unfixed.quotas is not None:  # the same plan, padded or not
                assert torch.equal(got.quotas, unfixed.quotas), selector.name


def test_an_update_with_a_bad_map_changes_nothing() -> None:
    layout = ReplicaLayout([0, 1, 2, 0], 3, 2, fixed=True)
    snapshot = layout.phy2log.clone()
    with pytest.raises(Exception, match="every expert a slot"):
        layout.update([0, 1, 1, 0])
    with pytest.raises(Exception, match="must hold 4 slots"):
        layout.update([0, 1, 2])
    assert torch.equal(layout.phy2log, snapshot)
