"""Test helper: tiny random transformers MoE models, their MoE blocks and saved tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from deepinfer_kit.moe import MoEConfig, MoELayer

_COMMON: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=64,
    initializer_range=0.2,
)

ARCHS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "glm4_moe": dict(
        moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=3, n_group=4,
        topk_group=2, n_shared_experts=2, first_k_dense_replace=0, routed_scaling_factor=2.5,
        norm_topk_prob=True,
    ),
    "qwen2_moe": dict(
        moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
        shared_expert_intermediate_size=24, norm_topk_prob=False,
    ),
}

MLP_PREFIX = {"mixtral": "model.layers.0.block_sparse_moe.", "qwen3_moe": "model.layers.0.mlp.",
              "glm4_moe": "model.layers.0.mlp.", "qwen2_moe": "model.layers.0.mlp."}


def tiny_model(arch: str, *, experts_implementation: str = "eager", seed: int = 0) -> Any:
    """A 1-layer random transformers model of ``arch`` in float32 (bias randomized too)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(arch, **_COMMON, **ARCHS[arch])
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation=experts_implementation)
    gate = model.model.layers[0].mlp.gate
    if hasattr(gate, "e_score_correction_bias"):
        with torch.no_grad():
            gate.e_score_correction_bias.copy_(torch.randn_like(gate.e_score_correction_bias) * 0.2)
    return model.eval()


def saved_tensors(model: Any, folder: Path) -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` writes, read back with safetensors."""
    from safetensors.torch import load_file

    model.save_pretrained(folder)
    return load_file(str(folder / "model.safetensors"))


def layer_from_saved(model: Any, folder: Path, arch: str, **kwargs: Any) -> MoELayer:
    """An MoELayer built from the saved config.json and loaded from the saved tensors."""
    import json

    tensors = saved_tensors(model, folder)
    config = MoEConfig.from_hf(json.loads((folder / "config.json").read_text()))
    layer = MoELayer(config, **kwargs)
    layer.load_hf_weights(tensors, MLP_PREFIX[arch])
    return layer
