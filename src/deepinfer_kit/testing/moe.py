"""Conformance suites for Router and Dispatcher.

Router checks need a ``factory(hidden_size, num_experts, top_k)`` returning a router with
fixed, non-trivial random weights. Dispatcher checks need a ``factory(num_experts)``
returning a dispatcher that runs in this process (an expert-parallel one over a world of 1
qualifies). Token copies are tracked by writing each token's index into its hidden row, so
the checks see exactly which copy went where.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.moe.protocols import Dispatcher, Router
from deepinfer_kit.moe.records import Dispatched, Routing
from deepinfer_kit.testing.suite import Suite, expect

__all__ = ["RouterFactory", "DispatcherFactory", "ROUTER_SUITE", "DISPATCHER_SUITE"]

RouterFactory = Callable[[int, int, int], Router]
"""``factory(hidden_size, num_experts, top_k)`` -> a router with fixed random weights."""

DispatcherFactory = Callable[[int], Dispatcher]
"""``factory(num_experts)`` -> a dispatcher that runs in this process."""

ROUTER_SUITE: Suite[RouterFactory] = Suite("Router", "factory(hidden_size, num_experts, top_k) -> Router")
DISPATCHER_SUITE: Suite[DispatcherFactory] = Suite("Dispatcher", "factory(num_experts) -> Dispatcher")


def _hidden(tokens: int, size: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(tokens, size, generator=torch.Generator().manual_seed(seed))


@ROUTER_SUITE.check
def check_routing_shapes_and_range(factory: RouterFactory) -> None:
    router = factory(32, 8, 2)
    expect((router.num_experts, router.top_k) == (8, 2), "num_experts / top_k must echo the factory")
    routing = router(_hidden(10, 32))
    expect(routing.expert_ids.shape == (10, 2), f"expert_ids shape {tuple(routing.expert_ids.shape)}")
    expect(routing.weights.shape == (10, 2), f"weights shape {tuple(routing.weights.shape)}")
    expect(routing.expert_ids.dtype == torch.int64, f"expert_ids dtype {routing.expert_ids.dtype}")
    expect(routing.weights.dtype == torch.float32, f"weights dtype {routing.weights.dtype}")
    ids = routing.expert_ids
    expect(bool(((ids >= 0) & (ids < 8)).all()), "expert ids out of [0, E)")
    distinct = all(len(set(row.tolist())) == 2 for row in ids)
    expect(distinct, "a token must not pick the same expert twice")
    expect(bool(torch.isfinite(routing.weights).all()), "weights must be finite")


@ROUTER_SUITE.check
def check_pure_and_deterministic(factory: RouterFactory) -> None:
    router = factory(16, 6, 3)
    hidden = _hidden(9, 16, seed=1)
    before = hidden.clone()
    a, b = router(hidden), router(hidden)
    expect(torch.equal(hidden, before), "the router mutated its input")
    expect(torch.equal(a.expert_ids, b.expert_ids), "same input, different experts")
    expect(torch.equal(a.weights, b.weights), "same input, different weights")


@ROUTER_SUITE.check
def check_each_token_routed_independently(factory: RouterFactory) -> None:
    router = factory(16, 8, 2)
    hidden = _hidden(12, 16, seed=2)
    whole = router(hidden)
    rows = torch.tensor([7, 0, 11, 3])
    part = router(hidden[rows])
    for got, want in ((part.expert_ids, whole.expert_ids[rows]), (part.weights, whole.weights[rows])):
        expect(
            torch.equal(got.sort(dim=1).values, want.sort(dim=1).values),
            "a token's routing must not depend on the other tokens of the batch",
        )


@ROUTER_SUITE.check
def check_empty_batch_and_counts(factory: RouterFactory) -> None:
    for experts in (5, 8):
        empty = factory(16, experts, 2)(_hidden(0, 16))
        expect(empty.expert_ids.shape == (0, 2), f"T=0 expert_ids shape {tuple(empty.expert_ids.shape)}")
    router = factory(16, 5, 2)
    routing = router(_hidden(13, 16, seed=3))
    counts = routing.expert_counts(5)
    expect(counts.shape == (5,) and int(counts.sum()) == 26, f"expert_counts {counts.tolist()}")
    want = Counter(routing.expert_ids.flatten().tolist())
    expect(all(int(counts[e]) == want[e] for e in range(5)), "expert_counts disagree with ids")


@ROUTER_SUITE.check
def check_low_precision_input(factory: RouterFactory) -> None:
    router = factory(16, 8, 2)
    routing = router(_hidden(6, 16, seed=4).to(torch.bfloat16))
    expect(routing.expert_ids.dtype == torch.int64, "bf16 input: expert_ids must stay int64")
    expect(bool(torch.isfinite(routing.weights).all()), "bf16 input: weights must be finite")


def _routing(tokens: int, experts: int, top_k: int, seed: int) -> Routing:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack(
        [torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]
        or [torch.empty(0, top_k, dtype=torch.int64)]
    )
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    return Routing(expert_ids=ids.reshape(tokens, top_k), weights=weights / weights.sum(1, keepdim=True))


def _marked(tokens: int, size: int) -> torch.Tensor:
    """Row ``t`` starts with ``t`` so every copy names its token; the rest is noise."""
    hidden = _hidden(tokens, size, seed=tokens)
    hidden[:, 0] = torch.arange(tokens, dtype=hidden.dtype)
    return hidden


def _slot_of_rows(dispatched: Dispatched) -> list[int]:
    return [s for s, n in enumerate(dispatched.expert_counts.tolist()) for _ in range(n)]


@DISPATCHER_SUITE.check
def check_identity_experts_round_trip(factory: DispatcherFactory) -> None:
    hidden = _hidden(12, 16)
    dispatcher = factory(6)
    dispatched = dispatcher.dispatch(hidden, _routing(12, 6, 3, seed=0))
    out = dispatcher.combine(dispatched.hidden, dispatched)
    expect(out.shape == hidden.shape, f"combine shape {tuple(out.shape)}")
    expect(torch.allclose(out, hidden, atol=1e-5), "identity experts must return the input")


@DISPATCHER_SUITE.check
def check_copies_grouped_by_their_expert(factory: DispatcherFactory) -> None:
    dispatcher = factory(5)
    local = dispatcher.local_experts
    expect(set(local) == set(range(5)), f"a single-process dispatcher must hold every expert, got {local}")
    routing = _routing(17, 5, 2, seed=1)
    dispatched = dispatcher.dispatch(_marked(17, 8), routing)
    counts = dispatched.expert_counts
    expect(counts.device.type == "cpu" and counts.dtype == torch.int64, "expert_counts: host int64")
    expect(counts.shape == (len(local),), f"expert_counts shape {tuple(counts.shape)}")
    expect(int(counts.sum()) == dispatched.hidden.shape[0] == 34, f"M = {dispatched.hidden.shape[0]}")
    expect(dispatched.num_tokens == 17, f"num_tokens {dispatched.num_tokens}")
    routed = dispatched.routed_counts
    expect(
        routed.device.type == "cpu" and torch.equal(routed, routing.expert_counts(5)),
        f"routed_counts {routed.tolist()} must be routing.expert_counts(E) on the host",
    )
    tokens = dispatched.hidden[:, 0].round().long().tolist()
    pairs = Counter((t, local[s]) for t, s in zip(tokens, _slot_of_rows(dispatched)))
    wanted = Counter((t, int(e)) for t in range(17) for e in routing.expert_ids[t])
    expect(pairs == wanted, "the (token, expert) copies differ from the routing")
    weight_of = {(t, int(e)): float(w) for t in range(17) for e, w in zip(routing.expert_ids[t], routing.weights[t])}
    got_w = [float(w) for w in dispatched.weights]
    want_w = [weight_of[(t, local[s])] for t, s in zip(tokens, _slot_of_rows(dispatched))]
    expect(torch.allclose(torch.tensor(got_w), torch.tensor(want_w)), "weights not aligned with copies")


@DISPATCHER_SUITE.check
def check_combine_weights_each_expert_output(factory: DispatcherFactory) -> None:
    dispatcher = factory(4)
    hidden = _hidden(11, 8, seed=5)
    routing = _routing(11, 4, 2, seed=2)
    routing.weights = routing.weights * torch.tensor([1.0, 3.0])  # weights need not sum to 1
    dispatched = dispatcher.dispatch(hidden, routing)
    scale = torch.tensor([float(dispatcher.local_experts[s] + 1) for s in _slot_of_rows(dispatched)])
    out = dispatcher.combine(dispatched.hidden * scale[:, None], dispatched)
    factor = (routing.weights * (routing.expert_ids + 1).float()).sum(1, keepdim=True)
    expect(torch.allclose(out, hidden * factor, atol=1e-5), "combine must compute sum_e w_e E_e(x)")


@DISPATCHER_SUITE.check
def check_empty_batch_and_dtype(factory: DispatcherFactory) -> None:
    dispatcher = factory(4)
    empty = dispatcher.dispatch(_hidden(0, 8), _routing(0, 4, 2, seed=3))
    expect(empty.hidden.shape == (0, 8), f"T=0 dispatched shape {tuple(empty.hidden.shape)}")
    expect(dispatcher.combine(empty.hidden, empty).shape == (0, 8), "T=0 combine shape")
    hidden = _hidden(6, 8, seed=6).to(torch.bfloat16)
    dispatched = dispatcher.dispatch(hidden, _routing(6, 4, 2, seed=4))
    out = dispatcher.combine(dispatched.hidden, dispatched)
    expect(out.dtype == torch.bfloat16, f"combine must keep the dtype of expert_out, got {out.dtype}")
    expect(torch.allclose(out.float(), hidden.float(), atol=3e-2), "bf16 identity round trip")


@DISPATCHER_SUITE.check
def check_bad_routing_rejected(factory: DispatcherFactory) -> None:
    dispatcher = factory(4)
    hidden = _hidden(3, 8)
    bad = [
        Routing(expert_ids=torch.tensor([[0, 4], [1, 2], [2, 3]]), weights=torch.ones(3, 2)),
        Routing(expert_ids=torch.tensor([[0, -1], [1, 2], [2, 3]]), weights=torch.ones(3, 2)),
        Routing(expert_ids=torch.tensor([[0, 1], [1, 2]]), weights=torch.ones(2, 2)),
    ]
    for routing in bad:
        try:
            dispatcher.dispatch(hidden, routing)
        except ConfigError:
            continue
        raise AssertionError(f"dispatch accepted bad routing {routing.expert_ids.tolist()}")
