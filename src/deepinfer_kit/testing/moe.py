"""Conformance suites for Router and Dispatcher."""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer_kit.moe.protocols import Dispatcher, Router
from deepinfer_kit.testing.suite import Suite, expect

__all__ = ["RouterFactory", "DispatcherFactory", "ROUTER_SUITE", "DISPATCHER_SUITE"]

RouterFactory = Callable[[int, int, int], Router]
"""``factory(hidden_size, num_experts, top_k)`` -> a router with fixed random weights."""

DispatcherFactory = Callable[[int], Dispatcher]
"""``factory(num_experts)`` -> a single-process dispatcher."""

ROUTER_SUITE: Suite[RouterFactory] = Suite("Router", "factory(hidden_size, num_experts, top_k) -> Router")
DISPATCHER_SUITE: Suite[DispatcherFactory] = Suite("Dispatcher", "factory(num_experts) -> Dispatcher")


@ROUTER_SUITE.check
def check_routing_shapes_and_range(factory: RouterFactory) -> None:
    router = factory(32, 8, 2)
    hidden = torch.randn(10, 32, generator=torch.Generator().manual_seed(0))
    routing = router(hidden)
    expect(routing.expert_ids.shape == (10, 2), f"expert_ids shape {tuple(routing.expert_ids.shape)}")
    expect(routing.weights.shape == (10, 2), f"weights shape {tuple(routing.weights.shape)}")
    ids = routing.expert_ids
    expect(bool(((ids >= 0) & (ids < 8)).all()), "expert ids out of [0, E)")
    distinct = all(len(set(row.tolist())) == 2 for row in ids)
    expect(distinct, "a token must not pick the same expert twice")


@DISPATCHER_SUITE.check
def check_identity_experts_round_trip(factory: DispatcherFactory) -> None:
    from deepinfer_kit.moe.records import Routing

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(12, 16, generator=gen)
    ids = torch.stack([torch.randperm(6, generator=gen)[:3] for _ in range(12)])
    weights = torch.full((12, 3), 1.0 / 3.0)
    dispatcher = factory(6)
    dispatched = dispatcher.dispatch(hidden, Routing(expert_ids=ids, weights=weights))
    out = dispatcher.combine(dispatched.hidden, dispatched)
    expect(out.shape == hidden.shape, f"combine shape {tuple(out.shape)}")
    expect(torch.allclose(out, hidden, atol=1e-5), "identity experts must return the input")
