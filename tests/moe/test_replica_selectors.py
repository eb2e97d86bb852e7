"""ReplicaSelector: every implementation passes the conformance suite; the suite catches
planted bugs; the balancer reaches the exact optimum on cases small enough to enumerate."""

from __future__ import annotations

import itertools

import pytest
import torch

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.moe.replica_layout import ReplicaLayout, Selection
from deepinfer_kit.moe.selectors import (
    BalancedSelector, EvenSelector, StaticSelector, gpu_load_of, make_selector, makespan_lower_bound,
)
from deepinfer_kit.testing.replica_selector import REPLICA_SELECTOR_SUITE, rank_batches
from deepinfer_kit.testing.suite import ConformanceError

FACTORIES = {"static": StaticSelector, "even": EvenSelector, "balanced": BalancedSelector,
             "balanced-greedy": lambda: BalancedSelector(sweeps=1)}


@pytest.mark.parametrize("name", FACTORIES)
@pytest.mark.parametrize("check", REPLICA_SELECTOR_SUITE.checks, ids=REPLICA_SELECTOR_SUITE.ids)
def test_selectors_conform(check, name: str) -> None:  # type: ignore[no-untyped-def]
    check(FACTORIES[name])


class _WrongExpert(EvenSelector):
    def select(self, expert_ids, counts, rank, layout):  # type: ignore[no-untyped-def]
        sel = super().select(expert_ids, counts, rank, layout)
        slots = (sel.slots + 1) % layout.num_slots  # the next slot: another expert's
        return Selection(slots, torch.bincount(slots, minlength=layout.num_slots), sel.quotas)


class _MisReports(BalancedSelector):
    def select(self, expert_ids, counts, rank, layout):  # type: ignore[no-untyped-def]
        sel = super().select(expert_ids, counts, rank, layout)
        return Selection(sel.slots, sel.sent.flip(0), sel.quotas)


class _RankDependent(EvenSelector):
    def select(self, expert_ids, counts, rank, layout):  # type: ignore[no-untyped-def]
        sel = super().select(expert_ids, counts, rank, layout)
        quotas = sel.quotas + rank if sel.quotas is not None else None
        return Selection(sel.slots, sel.sent, quotas)


class _Unbalanced(EvenSelector):
    def _quotas(self, total, tables):  # type: ignore[no-untyped-def]
        first = torch.zeros(tables.layout.num_slots + 2, dtype=torch.int64)
        return first.index_add_(0, tables.first_slot, total)  # every copy to the first replica


class _NoChecks(StaticSelector):
    def select(self, expert_ids, counts, rank, layout):  # type: ignore[no-untyped-def]
        position = torch.arange(expert_ids.numel()) + rank  # the rule without its shape checks
        slots = layout.log2phy[expert_ids, position % layout.logcnt[expert_ids]]
        return Selection(slots, torch.bincount(slots, minlength=layout.num_slots), None)


@pytest.mark.parametrize(("broken", "check"), [
    (_WrongExpert, "every_copy_goes_to_a_replica_of_its_expert"),
    (_MisReports, "reported_load_equals_dispatched_load"),
    (_RankDependent, "plan_identical_across_ranks_and_calls"),
    (_Unbalanced, "no_worse_than_even_on_the_busiest_gpu"),
    (_NoChecks, "bad_shapes_raise"),
])
def test_the_suite_catches_planted_bugs(broken: type, check: str) -> None:
    target = next(c for c in REPLICA_SELECTOR_SUITE.checks if c.name == check)
    with pytest.raises(ConformanceError):
        target(broken)


def _optimum(counts: list[int], layout: ReplicaLayout) -> int:
    """The least busiest-GPU load over every integer split (brute force, tiny cases)."""
    choices = []
    for e, c in enumerate(counts):
        slots = layout.log2phy[e, : int(layout.logcnt[e])].tolist()
        splits = [s for s in itertools.product(range(c + 1), repeat=len(slots)) if sum(s) == c]
        choices.append([(slots, s) for s in splits])
    best = None
    for pick in itertools.product(*choices):
        load = [0] * layout.num_gpus
        for slots, split in pick:
            for slot, n in zip(slots, split):
                load[int(layout.slot_gpu[slot])] += n
        best = max(load) if best is None else min(best, max(load))
    assert best is not None
    return best


@pytest.mark.parametrize("seed", range(6))
def test_balanced_reaches_the_brute_force_optimum_on_small_cases(seed: int) -> None:
    layout = ReplicaLayout([0, 1, 2, 0, 3, 1, 4, 0, 2], 5, 3)
    ids = rank_batches(5, [9], seed)[0]
    counts = torch.bincount(ids, minlength=5)
    quotas = BalancedSelector(sweeps=6).quotas(counts, layout)
    got = int(gpu_load_of(quotas, layout).max())
    best = _optimum(counts.tolist(), layout)
    assert got <= best + 1  # rounding: one copy per replica a GPU holds, at most
    bound = float(makespan_lower_bound(counts, layout, gpu_load_of(quotas, layout)))
    assert bound <= best + 1e-9


def test_balancer_beats_even_split_on_a_skewed_batch() -> None:
    layout = ReplicaLayout([0, 1, 2, 3, 0, 4, 5, 1, 6, 7, 0, 2], 8, 4)
    ids = rank_batches(8, [512], 3)[0]
    counts = torch.bincount(ids, minlength=8)
    even = gpu_load_of(EvenSelector().quotas(counts, layout), layout)
    balanced = BalancedSelector().quotas(counts, layout)
    loads = gpu_load_of(balanced, layout)
    assert int(loads.max()) < int(even.max())
    lower = float(makespan_lower_bound(counts, layout, loads))
    assert int(loads.max()) <= lower + 3  # certified: within rounding of the LP


def test_make_selector_and_bad_sweeps() -> None:
    assert [make_selector(n).name for n in ("static", "even", "balanced")] == ["static", "even", "balanced"]
    with pytest.raises(ConfigError, match="eplb.dispatch must be one of .*, got 'lp'"):
        make_selector("lp")
    with pytest.raises(ConfigError, match="sweeps must be an int >= 1, got 0"):
        BalancedSelector(sweeps=0)


@pytest.mark.parametrize("phy2log", [[0, 1, 2, 3, 0, 4, 5, 1, 6, 7, 0, 2], [0, 1, 2, 0, 3, 4, 0, 5, 6, 0, 7, 0],
                                     [0, 1, 2, 3, 4, 5, 6, 7]], ids=["three-replicated", "one-replicated", "none"])
@pytest.mark.parametrize("name", ["static", "even", "balanced"])
def test_selectors_read_nothing_back_to_the_host(name: str, phy2log: list[int]) -> None:
    """No op that needs the host to read device memory (a sync on CUDA, and a capture
    breaker): the selection, the first call's per-layout tables included, is device work
    only, over each path (several, one, no replicated expert; one rank and two)."""
    from moe_layers import no_host_reads

    layout = ReplicaLayout(phy2log, 8, 4)
    ids = rank_batches(8, [40, 24], 5)
    counts = torch.stack([torch.zeros(8, dtype=torch.int64).index_add_(0, i, torch.ones_like(i)) for i in ids])
    selector = make_selector(name)
    with no_host_reads():
        sel = selector.select(ids[1], counts, 1, layout)
        alone = make_selector(name).select(ids[0], counts[:1], 0, layout)
    assert torch.equal(layout.phy2log[sel.slots], ids[1])
    assert torch.equal(layout.phy2log[alone.slots], ids[0])
