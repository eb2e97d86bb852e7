"""ExpertBalancer alone: its schedule, its refusal to move weights mid-step, the window's
per-step rows it hands the policy, and that a layer keeps its placement when the plan
balances the window's steps no better."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kit.engine.runner.balance import ExpertBalancer
from deepinfer_kit.eplb import EplbConfig, HierarchicalPlacementPolicy, Placement, Topology
from deepinfer_kit.errors import InvariantError
from deepinfer_kit.moe import MoEConfig, MoELayer


class _Counts:
    """Stands in for the model: the counts its last forward routed."""

    def __init__(self, counts: torch.Tensor) -> None:
        self.counts = counts

    def expert_counts(self) -> torch.Tensor:
        return self.counts


class _Spy:
    """A placement policy that keeps every window it is handed."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def place(self, load: torch.Tensor, topology: Topology) -> Placement:
        self.seen.append(load.clone())
        return HierarchicalPlacementPolicy().place(load, topology)


def _balancer(spy: _Spy | None = None, **eplb: object) -> ExpertBalancer:
    config = MoEConfig(hidden_size=8, num_experts=4, top_k=2, intermediate_size=4)
    layers = [MoELayer(config, impl="ref") for _ in range(2)]
    return ExpertBalancer(EplbConfig(**eplb), layers, torch.device("cpu"), policy=spy)  # type: ignore[arg-type]


def test_the_policy_sees_the_recorded_steps_oldest_first() -> None:
    spy = _Spy()
    balancer = _balancer(spy, window=3, interval=2, num_redundant=2, num_gpus=2)
    counts = [torch.tensor([[s, 1, 2, 3], [4, 5, 6, s]]) for s in range(10, 15)]
    balancer.record(_Counts(counts[0]))  # type: ignore[arg-type]
    balancer.rebalance()  # one step recorded: a window of one step
    for c in counts[1:]:
        balancer.record(_Counts(c))  # type: ignore[arg-type]
    balancer.rebalance()  # five recorded, the window keeps three
    assert [tuple(s.shape) for s in spy.seen] == [(1, 2, 4), (3, 2, 4)]
    assert torch.equal(spy.seen[0][0], counts[0])
    assert torch.equal(spy.seen[1], torch.stack(counts[2:]))
    assert torch.equal(balancer.history[-1].window, torch.stack(counts[2:]).sum(0))  # the record keeps the sum
    fresh = _balancer(spy, window=3, interval=2, num_redundant=2, num_gpus=2)
    fresh.rebalance()  # nothing recorded: one step of zeros
    assert torch.equal(spy.seen[-1], torch.zeros(1, 2, 4, dtype=torch.int64))


def test_rebalances_fall_due_every_interval_and_never_mid_step() -> None:
    balancer = _balancer(None, window=2, interval=3, num_redundant=2, num_gpus=2)
    model = _Counts(torch.tensor([[5, 1, 1, 1], [1, 1, 1, 5]]))
    for step in range(1, 7):
        balancer.record(model)  # type: ignore[arg-type]
        assert not balancer.due() or step % 3 == 0  # the clock is committed rounds, not forwards
        balancer.commit()  # what the engine does as the round commits
        assert balancer.due() == (step % 3 == 0), step
        if balancer.due():
            with pytest.raises(InvariantError, match="rebalance with 1 steps in flight"):
                balancer.rebalance(in_flight=1)
            balancer.rebalance()
    assert [r.after_step for r in balancer.history] == [3, 6]
    assert torch.equal(balancer.window.total(), 2 * model.counts)


def test_a_layer_keeps_its_placement_when_the_plan_is_no_better() -> None:
    # The start (slots [2, 1, 0 | 3, 1, 0]) balances layer 0's window exactly (11.5 tokens
    # per GPU) where refine's greedy packing reaches 0.986: layer 0 keeps its slots, and
    # layer 1 (0.72 before) takes the plan.
    balancer = _balancer(None, window=1, interval=1, policy="refine", num_redundant=2, num_gpus=2)
    start = balancer.placement.phy2log.clone()
    balancer.record(_Counts(torch.tensor([[16, 5, 1, 1], [10, 5, 14, 2]])))  # type: ignore[arg-type]
    r = balancer.rebalance()
    assert torch.equal(r.before[0], torch.tensor([11.5, 11.5], dtype=torch.float64))
    assert torch.equal(r.phy2log[0], start[0]) and not torch.equal(r.phy2log[1], start[1])
    assert r.balancedness_after > r.balancedness_before
    assert r.moved_slots == int((r.phy2log != start).sum()) > 0


def test_the_keep_rule_judges_the_window_step_by_step() -> None:
    # The start holds experts {0, 2} | {1, 3}: balanced on the window's sum, but each step
    # sends all its tokens to one GPU (steps alternate hot {0, 2} and hot {1, 3}). The peak
    # policy pairs a hot expert of each step per GPU; judged per step the plan wins.
    balancer = _balancer(None, window=4, interval=4, policy="peak", num_redundant=0, num_gpus=2)
    assert balancer.placement.phy2log.tolist() == [[0, 2, 1, 3]] * 2
    for step in range(4):
        hot = torch.tensor([9, 0, 9, 0]) if step % 2 == 0 else torch.tensor([0, 9, 0, 9])
        balancer.record(_Counts(torch.stack([hot, hot])))  # type: ignore[arg-type]
    r = balancer.rebalance()
    assert r.before.tolist() == r.after.tolist() == [[36.0, 36.0]] * 2  # the sum cannot tell them apart
    assert r.balancedness_before == 0.5 and r.balancedness_after == 1.0
    for row in r.phy2log.tolist():
        assert sorted(row[:2]) in ([0, 1], [0, 3], [1, 2], [2, 3])
