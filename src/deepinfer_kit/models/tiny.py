"""The embedded default model: a tiny Qwen3-MoE-style config and its seeded random weights.

Nothing is read from disk or downloaded; the same seed always gives the same tensors (drawn
on the CPU from a private ``torch.Generator``), named as in a Hugging Face checkpoint so they
load through the same path as a real folder.
"""

from __future__ import annotations

from typing import Any

import torch

from deepinfer_kit.models.config import ModelConfig
from deepinfer_kit.models.tokenizer import ByteTokenizer

__all__ = ["tiny_hf_config", "tiny_hf_weights"]


def tiny_hf_config() -> dict[str, Any]:
    """``config.json`` of the tiny model: 2 layers, hidden 64, 8 experts top-2, vocab 259
    (the :class:`ByteTokenizer`), tied embeddings."""
    tokenizer = ByteTokenizer()
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": tokenizer.vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
        "attention_bias": False,
        "hidden_act": "silu",
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }


def tiny_hf_weights(config: ModelConfig, *, seed: int) -> dict[str, torch.Tensor]:
    """Seeded float32 CPU tensors for every parameter of ``config`` (a Qwen3-MoE layout).

    Embeddings are unit-variance and projections scaled by ``1/sqrt(fan_in)`` so activations
    keep their scale and the (tied) logits are peaked, which keeps greedy decoding away from
    near-ties.
    """
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return normal(out_features, in_features, std=in_features**-0.5)

    h, d = config.hidden_size, config.head_dim
    weights = {"model.embed_tokens.weight": normal(config.vocab_size, h, std=1.0),
               "model.norm.weight": torch.ones(h)}
    moe = config.moe
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = torch.ones(h)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(h)
        weights[p + "self_attn.q_proj.weight"] = linear(config.num_heads * d, h)
        weights[p + "self_attn.k_proj.weight"] = linear(config.num_kv_heads * d, h)
        weights[p + "self_attn.v_proj.weight"] = linear(config.num_kv_heads * d, h)
        weights[p + "self_attn.o_proj.weight"] = linear(h, config.num_heads * d)
        weights[p + "self_attn.q_norm.weight"] = torch.ones(d)
        weights[p + "self_attn.k_norm.weight"] = torch.ones(d)
        if moe is not None and i in config.sparse_layers:
            weights[p + "mlp.gate.weight"] = linear(moe.num_experts, h)
            size = moe.intermediate_size
            for e in range(moe.num_experts):
                q = f"{p}mlp.experts.{e}."
                weights[q + "gate_proj.weight"] = linear(size, h)
                weights[q + "up_proj.weight"] = linear(size, h)
                weights[q + "down_proj.weight"] = linear(h, size)
        else:
            size = config.intermediate_size
            weights[p + "mlp.gate_proj.weight"] = linear(size, h)
            weights[p + "mlp.up_proj.weight"] = linear(size, h)
            weights[p + "mlp.down_proj.weight"] = linear(h, size)
    if not config.tie_word_embeddings:
        weights["lm_head.weight"] = normal(config.vocab_size, h, std=h**-0.5)
    return weights
