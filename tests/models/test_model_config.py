"""ModelConfig parsing and RoPE frequencies, checked against transformers' own definitions."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer_kit.errors import CheckpointError, ConfigError
from deepinfer_kit.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from deepinfer_kit.models.rope import RotaryEmbedding, inverse_frequencies
from deepinfer_kit.models.tiny import tiny_hf_config

LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
}


def _random_rope(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["default", "linear", "llama3", "yarn"])
    params: dict[str, Any] = {"rope_type": kind, "rope_theta": rng.choice([1e4, 5e5, 1e6])}
    if kind != "default":
        params["factor"] = rng.choice([2.0, 4.0, 8.0, 32.0])
    if kind in ("llama3", "yarn"):
        params["original_max_position_embeddings"] = rng.choice([64, 4096, 8192])
    if kind == "llama3":
        params["low_freq_factor"] = rng.choice([1.0, 2.0])
        params["high_freq_factor"] = rng.choice([4.0, 8.0])
    if kind == "yarn":
        for key, values in (("beta_fast", [16.0, 32.0]), ("beta_slow", [1.0, 2.0]),
                            ("truncate", [True, False]), ("attention_factor", [None, 0.9])):
            if rng.random() < 0.5:
                params[key] = rng.choice(values)
        if rng.random() < 0.3:
            params["mscale"], params["mscale_all_dim"] = 0.707, 1.0
    return {k: v for k, v in params.items() if v is not None}


@pytest.mark.parametrize("seed", range(24))
def test_rope_frequencies_match_transformers(seed: int) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rng = random.Random(seed)
    head_dim = rng.choice([16, 32, 64, 128])
    hf = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                     max_position_embeddings=rng.choice([2048, 32768]),
                     rope_parameters=_random_rope(rng))
    ours = ModelConfig.from_hf_config(hf.to_dict())
    inv_freq, scale = inverse_frequencies(ours.rope)
    kind = hf.rope_parameters["rope_type"]
    if kind == "default":
        expected = 1.0 / (hf.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
        expected_scale = 1.0
    else:
        expected, expected_scale = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    torch.testing.assert_close(inv_freq, expected.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(expected_scale)


def test_partial_rotary_leaves_the_tail_unrotated() -> None:
    config = ModelConfig.from_hf_config(LLAMA | {"partial_rotary_factor": 0.5})
    assert config.rope.rotary_dim == 4
    rotary = RotaryEmbedding(config.rope)
    x = torch.randn(5, 3, 8)
    cos, sin = rotary.cos_sin(torch.arange(5) + 7, torch.float32)
    y = rotary.rotate(x, cos, sin)
    assert torch.equal(y[..., 4:], x[..., 4:])
    assert not torch.allclose(y[..., :4], x[..., :4])
    # A rotation keeps the norm of every rotated pair.
    torch.testing.assert_close(y[..., :4].norm(dim=-1), x[..., :4].norm(dim=-1))


def test_transformers_4_layout_reads_rope_scaling_and_type_alias() -> None:
    config = ModelConfig.from_hf_config(LLAMA | {"rope_scaling": {"type": "linear", "factor": 2.0}})
    assert (config.rope.rope_type, config.rope.factor, config.rope.theta) == ("linear", 2.0, 500000.0)


@pytest.mark.parametrize("kind", ["dynamic", "longrope", "mrope"])
def test_unsupported_rope_type_is_named(kind: str) -> None:
    with pytest.raises(ConfigError, match=f"rope_type.*{kind}"):
        ModelConfig.from_hf_config(LLAMA | {"rope_scaling": {"rope_type": kind, "factor": 2.0}})


@pytest.mark.parametrize(("change", "field"), [
    ({"num_key_value_heads": 3}, "num_heads"),
    ({"hidden_size": None}, "hidden_size"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
    ({"eos_token_id": 100}, "special token"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    ({"architectures": ["BertModel"]}, "BertModel"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
])
def test_invalid_field_is_named(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf_config(LLAMA | change)


def test_head_dim_defaults_to_hidden_over_heads_and_may_differ() -> None:
    assert ModelConfig.from_hf_config(LLAMA).head_dim == 8
    assert ModelConfig.from_hf_config(LLAMA | {"head_dim": 32}).head_dim == 32


def test_architecture_may_come_from_model_type_alone() -> None:
    for arch, model_type in SUPPORTED_ARCHITECTURES.items():
        raw = {k: v for k, v in tiny_hf_config().items() if k != "architectures"}
        raw |= {"model_type": model_type, "n_routed_experts": 8, "num_local_experts": 8,
                "moe_intermediate_size": 16}
        raw |= {"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8}  # MLA
        if model_type == "gemma3_text":  # its rope_parameters are keyed by layer type
            raw.pop("rope_parameters")
        assert ModelConfig.from_hf_config(raw).architecture == arch


@pytest.mark.parametrize(("raw", "sparse"), [
    ({"model_type": "qwen3_moe", "mlp_only_layers": [0, 3]}, (1, 2)),
    ({"model_type": "qwen3_moe", "decoder_sparse_step": 2}, (1, 3)),
    ({"model_type": "glm4_moe", "first_k_dense_replace": 3, "n_routed_experts": 8}, (3,)),
    ({"model_type": "deepseek_v3", "first_k_dense_replace": 2, "n_routed_experts": 8, "kv_lora_rank": 16,
      "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8}, (2, 3)),
    ({"model_type": "mixtral", "num_local_experts": 8}, (0, 1, 2, 3)),
])
def test_sparse_layers_follow_the_family_rule(raw: dict[str, Any], sparse: tuple[int, ...]) -> None:
    base = {k: v for k, v in tiny_hf_config().items() if k != "architectures"}
    config = ModelConfig.from_hf_config(base | {"num_hidden_layers": 4, "moe_intermediate_size": 16} | raw)
    assert config.sparse_layers == sparse
    assert config.moe is not None and config.moe.num_experts == 8


def test_sliding_windows_per_family() -> None:
    mixtral = ModelConfig.from_hf_config(
        tiny_hf_config() | {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                            "num_local_experts": 8, "sliding_window": 7})
    assert [mixtral.sliding_window(i) for i in range(2)] == [7, 7]
    qwen2 = {**LLAMA, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
             "sliding_window": 9, "max_window_layers": 1}
    assert ModelConfig.from_hf_config(qwen2).sliding_windows == ()
    on = ModelConfig.from_hf_config(qwen2 | {"use_sliding_window": True})
    assert on.sliding_windows == (None, 9)
    typed = ModelConfig.from_hf_config(
        qwen2 | {"use_sliding_window": True, "layer_types": ["sliding_attention", "full_attention"]})
    assert typed.sliding_windows == (9, None)


def test_from_pretrained_merges_generation_eos(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA | {"eos_token_id": 2, "bos_token_id": 1}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    config = ModelConfig.from_pretrained(tmp_path)
    assert config.eos_token_ids == (2, 7) and config.bos_token_id == 1


def test_from_pretrained_rejects_bad_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path)


_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024}


@pytest.mark.parametrize(("field", "change"), [
    ("head_dim", {"head_dim": "16"}),
    ("head_dim", {"head_dim": 16.0}),
    ("head_dim", {"head_dim": True}),
    ("hidden_size", {"hidden_size": "64"}),
    ("hidden_size", {"hidden_size": 64.5}),
    ("num_attention_heads", {"num_attention_heads": 4.0}),
    ("num_key_value_heads", {"num_key_value_heads": "2"}),
    ("num_hidden_layers", {"num_hidden_layers": True}),
    ("vocab_size", {"vocab_size": 259.0}),
    ("max_position_embeddings", {"max_position_embeddings": "4096"}),
    ("intermediate_size", {"intermediate_size": 128.0}),
    ("rms_norm_eps", {"rms_norm_eps": "1e-6"}),
    ("rms_norm_eps", {"rms_norm_eps": True}),
    ("rope_theta", {"rope_parameters": {"rope_type": "default", "rope_theta": "10000"}}),
    ("rope_theta", {"rope_parameters": None, "rope_theta": False}),
    ("partial_rotary_factor", {"partial_rotary_factor": "0.5"}),
    ("factor", {"rope_parameters": _YARN | {"factor": "4"}}),
    ("original_max_position_embeddings",
     {"rope_parameters": {k: v for k, v in _YARN.items() if k != "factor"}
      | {"original_max_position_embeddings": "1024"}}),
    ("original_max_position_embeddings",
     {"rope_parameters": _YARN | {"original_max_position_embeddings": 1024.0}}),
    ("beta_fast", {"rope_parameters": _YARN | {"beta_fast": "32"}}),
    ("truncate", {"rope_parameters": _YARN | {"truncate": "no"}}),
    ("num_experts", {"num_experts": "8"}),
    ("num_experts", {"num_experts": 8.0}),
    ("decoder_sparse_step", {"decoder_sparse_step": 1.0}),
    ("mlp_only_layers", {"mlp_only_layers": "0"}),
    ("mlp_only_layers", {"mlp_only_layers": [0.0]}),
    ("tie_word_embeddings", {"tie_word_embeddings": 1}),
    ("eos_token_id", {"eos_token_id": 257.0}),
    ("bos_token_id", {"bos_token_id": "256"}),
    ("use_sliding_window", {"use_sliding_window": "yes", "sliding_window": 8}),
    ("sliding_window", {"use_sliding_window": True, "sliding_window": "8"}),
])
def test_mistyped_config_json_field_names_field_value_and_file(
    tmp_path: Path, field: str, change: dict[str, Any]
) -> None:
    raw = tiny_hf_config() | change
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_pretrained(tmp_path)
    message = str(err.value)
    bad = change.get(field, raw.get(field))
    if bad is None:  # nested under rope_parameters
        bad = next(v[field] for v in change.values() if isinstance(v, dict) and field in v)
    assert field in message and repr(bad) in message and str(config_file) in message, message
