"""Seeded random weights for MoE layers built by the moe tests."""

from __future__ import annotations

import torch

from deepinfer_kit.moe import MoELayer


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
