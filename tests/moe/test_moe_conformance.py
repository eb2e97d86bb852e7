"""Every Router and Dispatcher here passes its conformance suite from deepinfer_kit.testing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from deepinfer_kit.moe import DeepSeekV3Router, LocalDispatcher, SoftmaxTopKRouter
from deepinfer_kit.moe.ep_dispatcher import ExpertParallelDispatcher
from deepinfer_kit.testing.moe import DISPATCHER_SUITE, ROUTER_SUITE
from deepinfer_kit.testing.suite import Check, ConformanceError


def _random_weights(router: SoftmaxTopKRouter | DeepSeekV3Router, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))


def softmax_factory(hidden: int, experts: int, top_k: int) -> SoftmaxTopKRouter:
    router = SoftmaxTopKRouter(hidden, experts, top_k, renormalize=True)
    _random_weights(router, 0)
    return router


def deepseek_factory(hidden: int, experts: int, top_k: int) -> DeepSeekV3Router:
    groups = 2 if experts % 2 == 0 and experts // 2 >= max(top_k, 2) else 1
    router = DeepSeekV3Router(hidden, experts, top_k, n_group=groups, topk_group=1, routed_scaling_factor=2.0)
    _random_weights(router, 1)
    bias = router.get_buffer("e_score_correction_bias")
    bias.copy_(torch.randn(experts, generator=torch.Generator().manual_seed(2)) * 0.3)
    return router


@pytest.fixture(scope="module")
def world_of_one() -> Iterator[None]:
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("check", ROUTER_SUITE.checks, ids=ROUTER_SUITE.ids)
@pytest.mark.parametrize("factory", [softmax_factory, deepseek_factory], ids=["softmax", "deepseek_v3"])
def test_router_conforms(check: Check, factory) -> None:  # type: ignore[no-untyped-def]
    check(factory)


@pytest.mark.parametrize("check", DISPATCHER_SUITE.checks, ids=DISPATCHER_SUITE.ids)
def test_local_dispatcher_conforms(check: Check) -> None:  # type: ignore[type-arg]
    check(LocalDispatcher)


@pytest.mark.parametrize("check", DISPATCHER_SUITE.checks, ids=DISPATCHER_SUITE.ids)
@pytest.mark.parametrize("replicas", [0, 3])
def test_expert_parallel_dispatcher_conforms_in_a_world_of_one(
    check: Check, replicas: int, world_of_one: None  # type: ignore[type-arg]
) -> None:
    def factory(experts: int) -> ExpertParallelDispatcher:
        phy2log = list(range(experts)) + [e % experts for e in range(replicas)]
        return ExpertParallelDispatcher(experts, phy2log[::-1])

    check(factory)


class _DropsAToken:
    """A broken dispatcher: loses the last token's copies (the suite must catch it)."""

    def __init__(self, experts: int) -> None:
        self.inner = LocalDispatcher(experts)
        self.local_experts = self.inner.local_experts

    def dispatch(self, hidden, routing):  # type: ignore[no-untyped-def]
        routing.weights = routing.weights.clone()
        routing.weights[-1:] = 0.0
        return self.inner.dispatch(hidden, routing)

    def combine(self, expert_out, dispatched):  # type: ignore[no-untyped-def]
        return self.inner.combine(expert_out, dispatched)


def test_suites_catch_broken_implementations() -> None:
    with pytest.raises(ConformanceError):
        DISPATCHER_SUITE.run(_DropsAToken)

    def repeats_experts(hidden: int, experts: int, top_k: int) -> SoftmaxTopKRouter:
        router = softmax_factory(hidden, experts, top_k)
        original = router.forward

        def forward(x: torch.Tensor):  # type: ignore[no-untyped-def]
            r = original(x)
            r.expert_ids[:, 1:] = r.expert_ids[:, :1]
            return r

        router.forward = forward  # type: ignore[method-assign]
        return router

    with pytest.raises(ConformanceError, match="same expert twice"):
        ROUTER_SUITE.run(repeats_experts)
