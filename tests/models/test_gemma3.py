"""Gemma 3 text specifics: its config fields against transformers' own reading of them (both
layouts), the fields refused by name, and the model pieces the family switches (torch ops
for the (1 + w) norms and GELU, no fused RoPE + KV write, the embedding scale's rounding).
Logits and greedy decoding against transformers are in test_families.py ("gemma3")."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.causal_lm import TransformerCausalLM
from deepinfer_kit.models.config import ModelConfig
from deepinfer_kit.models.fused_ops import gelu_tanh_and_mul, offset_add_rms_norm, offset_rms_norm
from deepinfer_kit.models.rope import inverse_frequencies
from deepinfer_kit.models.rope_kv import rope_kv_unsupported

BASE: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 64,
    "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 7, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
    "eos_token_id": 1, "bos_token_id": 2, "pad_token_id": 0,
}
_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
          "full_attention", "full_attention", "sliding_attention"]
LAYOUTS: dict[str, dict[str, Any]] = {
    "5.x": {"query_pre_attn_scalar": 20, "sliding_window": 9, "layer_types": _TYPES,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 3000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 5e5}}},
    "4.x": {"query_pre_attn_scalar": 20, "sliding_window": 9, "sliding_window_pattern": 3,
            "rope_theta": 5e5, "rope_local_base_freq": 3000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
    "defaults": {},  # pattern 6, window 4096, bases 1e6 / 1e4, scalar 256, tied
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_config_reads_what_transformers_builds(layout: str) -> None:
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    raw = BASE | LAYOUTS[layout]
    hf = Gemma3TextConfig.from_dict(raw)
    ours = ModelConfig.from_hf_config(raw)
    assert ours.sliding_windows == tuple(hf.sliding_window if t == "sliding_attention" else None
                                         for t in hf.layer_types)
    assert ours.attn_scale == hf.query_pre_attn_scalar**-0.5
    assert ours.embed_scale == hf.hidden_size**0.5
    assert (ours.tie_word_embeddings, ours.qk_norm, ours.norm_offset, ours.sandwich_norms,
            ours.hidden_act) == (True, True, True, True, "gelu_pytorch_tanh")
    rotary = Gemma3RotaryEmbedding(hf)
    assert ours.local_rope is not None
    for rope, kind in ((ours.rope, "full_attention"), (ours.local_rope, "sliding_attention")):
        inv_freq, scale = inverse_frequencies(rope)
        assert torch.equal(inv_freq, getattr(rotary, f"{kind}_inv_freq"))
        assert scale == getattr(rotary, f"{kind}_attention_scaling")
    # The config.json transformers 5 writes for it reads the same.
    assert ModelConfig.from_hf_config(hf.to_dict() | {"architectures": BASE["architectures"]}) == ours


@pytest.mark.parametrize(("change", "field", "shown"), [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping", "30.0"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping", "50.0"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention", "True"),
    ({"hidden_activation": "gelu"}, "hidden_activation", "'gelu'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "rope_parameters", "'rope_theta'"),
    ({"rope_scaling": {"type": "linear", "factor": 8.0}}, "type", "'linear'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0}}}, "rope_type", "'dynamic'"),
    ({"rope_parameters": {"sliding_attention": {"partial_rotary_factor": 0.5}}}, "partial_rotary_factor", "0.5"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types", "['full_attention'"),
    ({"layer_types": ["chunked_attention"] * 7}, "layer_types", "'chunked_attention'"),
    ({"sliding_window_pattern": 0}, "sliding_window_pattern", "0"),
    ({"sliding_window": "512"}, "sliding_window", "'512'"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar", "0"),
])
def test_unsupported_or_bad_field_is_named_with_its_value(change: dict[str, Any], field: str,
                                                          shown: str) -> None:
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_hf_config(BASE | change)
    assert field in str(err.value) and shown in str(err.value), str(err.value)


def test_the_multimodal_gemma3_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="Gemma3ForConditionalGeneration"):
        ModelConfig.from_hf_config(BASE | {"architectures": ["Gemma3ForConditionalGeneration"]})


def test_norms_and_gelu_run_the_torch_ops_and_the_fused_rope_kv_is_refused() -> None:
    config = ModelConfig.from_hf_config(BASE)
    assert "1 + weight" in (rope_kv_unsupported(config) or "")
    model = TransformerCausalLM(config, attention_impl="ref", fused_impl="triton")
    ops = model.fused_ops
    assert (ops.impl, ops.rms_norm, ops.add_rms_norm, ops.silu_and_mul, ops.rope_kv) == (
        "ref", offset_rms_norm, offset_add_rms_norm, gelu_tanh_and_mul, None)
    assert model.rope_kv_reason is not None
    assert all(layer.self_attn.rope_kv is None for layer in model.decoder_layers)
    with pytest.raises(ConfigError, match="batch_invariant.*gemma3_text"):
        TransformerCausalLM(config, attention_impl="ref", batch_invariant=True)


@pytest.mark.parametrize(("hidden", "dtype"), [(3072, torch.bfloat16), (2560, torch.float16),
                                               (64, torch.float32)])
def test_embeddings_are_scaled_as_transformers_rounds_the_scale(hidden: int, dtype: torch.dtype) -> None:
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    config = ModelConfig.from_hf_config(BASE | {"hidden_size": hidden, "num_hidden_layers": 1})
    model = TransformerCausalLM(config, attention_impl="ref", dtype=dtype)
    hf = Gemma3TextScaledWordEmbedding(64, hidden, 0, embed_scale=hidden**0.5).to(dtype)
    with torch.no_grad():
        model.embed_tokens.copy_(hf.weight)
        ids = torch.arange(64)
        assert model.embed_multiplier is not None
        assert torch.equal(F.embedding(ids, model.embed_tokens) * model.embed_multiplier, hf(ids))
    if dtype == torch.bfloat16:
        assert model.embed_multiplier == 55.5  # sqrt(3072) = 55.43 rounds up in bfloat16
