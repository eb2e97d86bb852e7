"""ExpertBalancer alone: its schedule, its refusal to move weights mid-step, and that a
layer keeps its placement when the plan balances the window no better."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kit.engine.runner.balance import ExpertBalancer
from deepinfer_kit.eplb import EplbConfig
from deepinfer_kit.errors import InvariantError
from deepinfer_kit.moe import MoEConfig, MoELayer


class _Counts:
    """Stands in for the model: the counts its last forward routed."""

    def __init__(self, counts: torch.Tensor) -> None:
        self.counts = counts

    def expert_counts(self) -> torch.Tensor:
        return self.counts


def _balancer(**eplb: object) -> ExpertBalancer:
    config = MoEConfig(hidden_size=8, num_experts=4, top_k=2, intermediate_size=4)
    layers = [MoELayer(config, impl="ref") for _ in range(2)]
    return ExpertBalancer(EplbConfig(**eplb), layers, torch.device("cpu"))  # type: ignore[arg-type]


def test_rebalances_fall_due_every_interval_and_never_mid_step() -> None:
    balancer = _balancer(window=2, interval=3, num_redundant=2, num_gpus=2)
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
    balancer = _balancer(window=1, interval=1, policy="refine", num_redundant=2, num_gpus=2)
    start = balancer.placement.phy2log.clone()
    balancer.record(_Counts(torch.tensor([[16, 5, 1, 1], [10, 5, 14, 2]])))  # type: ignore[arg-type]
    r = balancer.rebalance()
    assert torch.equal(r.before[0], torch.tensor([11.5, 11.5], dtype=torch.float64))
    assert torch.equal(r.phy2log[0], start[0]) and not torch.equal(r.phy2log[1], start[1])
    assert r.balancedness_after > r.balancedness_before
    assert r.moved_slots == int((r.phy2log != start).sum()) > 0
