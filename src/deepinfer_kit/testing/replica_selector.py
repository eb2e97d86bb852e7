"""Conformance suite for ReplicaSelector (dispatch-time replica choice).

The checks need a ``factory()`` returning a selector. Every check runs over several slot
maps (one replica per expert; replicas on distinct GPUs; two replicas of an expert on one
GPU) and skewed batches split over ``W`` simulated ranks, each rank calling ``select``
with its own ids and the all-gathered ``[W, E]`` counts, as the expert-parallel dispatcher
does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.moe.protocols import ReplicaSelector
from deepinfer_kit.moe.replica_layout import ReplicaLayout, Selection
from deepinfer_kit.testing.suite import Suite, expect

__all__ = ["SelectorFactory", "REPLICA_SELECTOR_SUITE", "rank_batches"]

SelectorFactory = Callable[[], ReplicaSelector]
"""``factory()`` -> a replica selector."""

REPLICA_SELECTOR_SUITE: Suite[SelectorFactory] = Suite("ReplicaSelector", "factory() -> ReplicaSelector")

_LAYOUTS = (
    ([0, 1, 2, 3, 4, 5, 6, 7], 4),  # no replicas
    ([0, 1, 2, 3, 0, 4, 5, 1, 6, 7, 0, 2], 4),  # expert 0 on three GPUs, 1 and 2 on two
    ([0, 1, 2, 0, 3, 4, 0, 5, 6, 0, 7, 0], 4),  # one replicated expert, on every GPU
    ([0, 0, 1, 2, 3, 4, 5, 0, 6, 7, 1, 1], 3),  # expert 0 twice on GPU 0, expert 1 twice on GPU 2
)


def rank_batches(num_experts: int, tokens: list[int], seed: int) -> list[torch.Tensor]:
    """One ``[N_w]`` int64 tensor of skewed expert ids per rank (``tokens[w]`` copies each;
    Zipf-like popularity, seeded)."""
    gen = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** 1.2
    weights = weights[torch.randperm(num_experts, generator=gen)]
    return [torch.multinomial(weights, n, replacement=True, generator=gen) if n else
            torch.zeros(0, dtype=torch.int64) for n in tokens]


def _cases() -> Iterator[tuple[ReplicaLayout, list[torch.Tensor]]]:
    for phy2log, gpus in _LAYOUTS:
        experts = max(phy2log) + 1
        layout = ReplicaLayout(phy2log, experts, gpus)
        for seed, tokens in enumerate(([40], [1], [0], [17, 0, 33], [64, 64])):
            yield layout, rank_batches(experts, tokens, seed)


def _select_all(selector: ReplicaSelector, layout: ReplicaLayout,
                ids: list[torch.Tensor]) -> tuple[torch.Tensor, list[Selection]]:
    counts = torch.stack([torch.bincount(i, minlength=layout.num_experts) for i in ids])
    return counts, [selector.select(i, counts, w, layout) for w, i in enumerate(ids)]


@REPLICA_SELECTOR_SUITE.check
def check_every_copy_goes_to_a_replica_of_its_expert(factory: SelectorFactory) -> None:
    selector = factory()
    for layout, ids in _cases():
        _, selections = _select_all(selector, layout, ids)
        for rank_ids, sel in zip(ids, selections):
            expect(sel.slots.shape == rank_ids.shape and sel.slots.dtype == torch.int64,
                   f"slots must be [N] int64 like the ids, got {tuple(sel.slots.shape)} {sel.slots.dtype}")
            inside = bool(((sel.slots >= 0) & (sel.slots < layout.num_slots)).all())
            expect(inside, f"slots out of [0, {layout.num_slots}): {sel.slots.tolist()}")
            expect(torch.equal(layout.phy2log[sel.slots], rank_ids),
                   "a copy was sent to a slot that does not hold its expert")


@REPLICA_SELECTOR_SUITE.check
def check_reported_load_equals_dispatched_load(factory: SelectorFactory) -> None:
    selector = factory()
    for layout, ids in _cases():
        _, selections = _select_all(selector, layout, ids)
        dispatched = [torch.bincount(s.slots, minlength=layout.num_slots) for s in selections]
        for rank, (sel, got) in enumerate(zip(selections, dispatched)):
            expect(torch.equal(sel.sent, got),
                   f"rank {rank} reports {sel.sent.tolist()} copies per slot, dispatches {got.tolist()}")
        quotas = selections[0].quotas
        if quotas is not None:
            total = torch.stack(dispatched).sum(0)
            expect(torch.equal(quotas, total),
                   f"quotas {quotas.tolist()} differ from what the ranks dispatch together {total.tolist()}")


@REPLICA_SELECTOR_SUITE.check
def check_plan_identical_across_ranks_and_calls(factory: SelectorFactory) -> None:
    selector, again = factory(), factory()
    for layout, ids in _cases():
        _, first = _select_all(selector, layout, ids)
        _, second = _select_all(again, layout, ids)
        for a, b in zip(first, second):
            expect(torch.equal(a.slots, b.slots) and torch.equal(a.sent, b.sent),
                   "two calls on the same batch chose different slots")
        plans = [s.quotas for s in first]
        if plans[0] is not None:
            same = all(p is not None and torch.equal(p, plans[0]) for p in plans)
            expect(same, f"ranks computed different whole-batch plans: {[None if p is None else p.tolist() for p in plans]}")


@REPLICA_SELECTOR_SUITE.check
def check_no_worse_than_even_on_the_busiest_gpu(factory: SelectorFactory) -> None:
    """Weak optimality: a count-based plan's busiest GPU carries at most what an even split's
    does plus one copy per replica it holds (rounding); a per-copy rule is exempt."""
    from deepinfer_kit.moe.selectors import EvenSelector, gpu_load_of

    selector = factory()
    for layout, ids in _cases():
        counts, selections = _select_all(selector, layout, ids)
        quotas = selections[0].quotas
        if quotas is None:
            continue
        even = EvenSelector().quotas(counts.sum(0), layout)
        mine, theirs = gpu_load_of(quotas, layout).max(), gpu_load_of(even, layout).max()
        slack = layout.num_slots // layout.num_gpus
        expect(bool(mine <= theirs + slack), f"busiest GPU {int(mine)} copies > even split's {int(theirs)} + {slack}")


@REPLICA_SELECTOR_SUITE.check
def check_bad_shapes_raise(factory: SelectorFactory) -> None:
    selector = factory()
    phy2log, gpus = _LAYOUTS[1]
    layout = ReplicaLayout(phy2log, 8, gpus)
    ids = torch.tensor([0, 1, 2])
    for counts, rank in ((torch.zeros(1, 5, dtype=torch.int64), 0),
                         (torch.bincount(ids, minlength=8)[None], 1)):
        try:
            selector.select(ids, counts, rank, layout)
        except ConfigError:
            continue
        expect(False, f"counts {list(counts.shape)} at rank {rank} must raise ConfigError")
