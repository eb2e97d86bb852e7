"""Seeded random MoE layers for the moe tests (and the strict host-read guard they use)."""

from __future__ import annotations

import random

import torch

from deepinfer_kit.moe import MoEConfig, MoELayer
from host_reads import no_host_reads

__all__ = ["make_layer", "no_host_reads", "randomize_moe_layer"]


def randomize_moe_layer(layer: MoELayer, seed: int, experts: int, deepseek: bool) -> MoELayer:
    """Fill every parameter with ``randn / sqrt(fan_in)`` from ``seed`` (and the
    DeepSeek-V3 routing bias when ``deepseek``); returns ``layer``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        if deepseek:
            layer.gate.get_buffer("e_score_correction_bias").copy_(torch.randn(experts, generator=gen) * 0.1)
    return layer


def make_layer(seed: int, *, shared: bool, impl: str, dtype: torch.dtype = torch.float32,
               device: str = "cpu") -> MoELayer:  # fmt: skip
    rng = random.Random(seed)
    experts = rng.choice([4, 8])
    deepseek = rng.random() < 0.5
    cfg = MoEConfig(
        hidden_size=rng.choice([16, 40]), num_experts=experts, top_k=rng.randint(1, 3),
        intermediate_size=rng.choice([8, 36]), routing="deepseek_v3" if deepseek else "softmax",
        norm_topk_prob=rng.random() < 0.5, n_group=2 if deepseek else 1, topk_group=2 if deepseek else 1,
        routed_scaling_factor=1.5 if deepseek else 1.0, num_shared_experts=int(shared),
        shared_intermediate_size=12 if shared else 0, shared_expert_gate=shared and rng.random() < 0.5,
    )  # fmt: skip
    layer = MoELayer(cfg, impl=impl, dtype=dtype, device=device)  # type: ignore[arg-type]
    return randomize_moe_layer(layer, seed, experts, deepseek)
