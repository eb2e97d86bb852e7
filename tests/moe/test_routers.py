"""Router invariants against a brute-force per-token oracle, and regressions 18-19."""

from __future__ import annotations

import math
import random

import pytest
import torch

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.moe import DeepSeekV3Router, SoftmaxTopKRouter


def _oracle_deepseek(logits: list[float], bias: list[float], k: int, groups: int, keep: int,
                     renorm: bool, scale: float) -> tuple[set[int], dict[int, float]]:
    """One token, in plain Python: biased group-limited selection, unbiased weights."""
    scores = [1 / (1 + math.exp(-v)) for v in logits]
    choice = [s + b for s, b in zip(scores, bias)]
    size = len(scores) // groups
    allowed = set(range(len(scores)))
    if groups > 1:
        group_score = [sum(sorted(choice[g * size:(g + 1) * size])[-2:]) for g in range(groups)]
        best = sorted(range(groups), key=lambda g: -group_score[g])[:keep]
        allowed = {e for g in best for e in range(g * size, (g + 1) * size)}
    chosen = sorted(allowed, key=lambda e: -choice[e])[:k]
    total = sum(scores[e] for e in chosen) if renorm else 1.0
    return set(chosen), {e: scores[e] / total * scale for e in chosen}


def _random_deepseek(rng: random.Random) -> tuple[DeepSeekV3Router, dict[str, float | int | bool]]:
    groups = rng.choice([1, 2, 4])
    size = rng.choice([2, 3, 4])
    experts = groups * size
    keep = rng.randint(1, groups)
    k = rng.randint(1, keep * size if groups > 1 else experts)
    params = dict(n_group=groups, topk_group=keep, renormalize=rng.random() < 0.7,
                  routed_scaling_factor=rng.choice([1.0, 2.5]))
    router = DeepSeekV3Router(8, experts, k, **params)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(rng.randint(0, 2**31))
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, 8, generator=gen))
        router.get_buffer("e_score_correction_bias").copy_(torch.randn(experts, generator=gen) * rng.choice([0.0, 0.5, 5.0]))
    return router, params | {"k": k}


@pytest.mark.parametrize("seed", range(40))
def test_deepseek_router_equals_brute_force_oracle(seed: int) -> None:
    rng = random.Random(seed)
    router, p = _random_deepseek(rng)
    hidden = torch.randn(6, 8, generator=torch.Generator().manual_seed(seed))
    routing = router(hidden)
    logits = router.logits(hidden).tolist()
    bias = router.get_buffer("e_score_correction_bias").tolist()
    for t in range(6):
        chosen, weights = _oracle_deepseek(logits[t], bias, int(p["k"]), int(p["n_group"]),
                                           int(p["topk_group"]), bool(p["renormalize"]),
                                           float(p["routed_scaling_factor"]))
        ids = routing.expert_ids[t].tolist()
        assert set(ids) == chosen
        for e, w in zip(ids, routing.weights[t].tolist()):
            assert w == pytest.approx(weights[e], rel=1e-5)


@pytest.mark.parametrize("seed", range(20))
def test_softmax_router_equals_brute_force_oracle(seed: int) -> None:
    rng = random.Random(seed)
    experts = rng.randint(1, 12)
    k = rng.randint(1, experts)
    renorm = rng.random() < 0.5
    router = SoftmaxTopKRouter(8, experts, k, renormalize=renorm)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, 8, generator=torch.Generator().manual_seed(seed)))
    hidden = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed + 1))
    routing = router(hidden)
    for t, row in enumerate(router.logits(hidden).tolist()):
        z = sum(math.exp(v) for v in row)
        probs = [math.exp(v) / z for v in row]
        chosen = sorted(range(experts), key=lambda e: -probs[e])[:k]
        total = sum(probs[e] for e in chosen) if renorm else 1.0
        assert set(routing.expert_ids[t].tolist()) == set(chosen)
        for e, w in zip(routing.expert_ids[t].tolist(), routing.weights[t].tolist()):
            assert w == pytest.approx(probs[e] / total, rel=1e-5)
        if renorm:
            assert sum(routing.weights[t].tolist()) == pytest.approx(1.0, rel=1e-6)


def test_regression_18_bias_changes_selection_never_weights() -> None:
    """Regression 18: the correction bias leaked into the combine weights."""
    router = DeepSeekV3Router(8, 8, 2, renormalize=False)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))
    hidden = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    scores = torch.sigmoid(router.logits(hidden))
    router.get_buffer("e_score_correction_bias")[5] = 100.0  # expert 5 always selected
    routing = router(hidden)
    assert bool((routing.expert_ids == 5).any(dim=1).all())
    torch.testing.assert_close(routing.weights, scores.gather(1, routing.expert_ids))
    assert float(routing.weights.max()) < 1.0  # a biased weight would be ~100


def test_regression_19_masked_groups_are_minus_inf_not_zero() -> None:
    """Regression 19: masked groups scored 0 and still beat negative biased scores."""
    router = DeepSeekV3Router(8, 8, 2, n_group=4, topk_group=1)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 8, generator=torch.Generator().manual_seed(2)))
        router.get_buffer("e_score_correction_bias").fill_(-10.0)  # every biased score < 0
    routing = router(torch.randn(64, 8, generator=torch.Generator().manual_seed(3)))
    groups = routing.expert_ids // 2
    assert bool((groups[:, 0] == groups[:, 1]).all()), "picked experts from a masked group"


def test_group_score_is_the_sum_of_the_top_two() -> None:
    # group 0: one huge expert (1 + 0) vs group 1: two good experts (0.8 + 0.8)
    router = DeepSeekV3Router(2, 4, 1, n_group=2, topk_group=1)
    bias = router.get_buffer("e_score_correction_bias")
    bias.copy_(torch.tensor([1.0, -1.0, 0.3, 0.3]))
    # zero gate weight: every score is sigmoid(0) = 0.5
    routing = router(torch.zeros(1, 2))
    assert routing.expert_ids.item() in (2, 3)  # max-of-group would have picked expert 0


def test_router_constructor_rejects_bad_groups() -> None:
    with pytest.raises(ConfigError, match="n_group must divide num_experts"):
        DeepSeekV3Router(4, 6, 2, n_group=4)
    with pytest.raises(ConfigError, match="topk_group must be <= n_group"):
        DeepSeekV3Router(4, 8, 2, n_group=2, topk_group=3)
    with pytest.raises(ConfigError, match="top_k must be <= num_experts"):
        SoftmaxTopKRouter(4, 3, 4)


def test_softmax_router_renormalizes_by_default() -> None:
    """The default of ``renormalize`` (Mixtral's rule) is pinned: every other test passes
    it explicitly, and flipped it leaves weights summing to well under 1."""
    router = SoftmaxTopKRouter(8, 8, 2)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 8, generator=torch.Generator().manual_seed(3)))
    routing = router(torch.randn(16, 8, generator=torch.Generator().manual_seed(4)))
    sums = routing.weights.sum(dim=-1)
    assert torch.allclose(sums, torch.ones(16), rtol=1e-6), sums
    assert router.renormalize
