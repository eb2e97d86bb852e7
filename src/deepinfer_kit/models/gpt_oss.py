"""gpt-oss (``GptOssForCausalLM``): its ``config.json`` read as transformers reads it.

:class:`~deepinfer_kit.models.config.ModelConfig` parses every family with one parser;
gpt-oss differs from it in defaults (a field missing from ``config.json`` means what
``transformers.GptOssConfig`` defaults it to: biased attention, YaRN RoPE with theta
150000, alternating sliding / full layers of window 128, ``rms_norm_eps`` 1e-5, ...) and
in its per-layer windows, which come from ``layer_types``. The model itself is the shared
decoder with flags: attention sinks (``ModelConfig.attention_sinks``), q/k/v/o biases,
and an MoE on every layer (``moe.MoEConfig.from_hf``'s ``gpt_oss`` reader: top-k-then-
softmax router with a bias, experts with biases and the clamped SwiGLU).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.config_parts import as_int

__all__ = ["GPT_OSS_DEFAULTS", "gpt_oss_hf_config", "layer_type_windows"]

GPT_OSS_DEFAULTS: Mapping[str, Any] = {
    "num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
    "sliding_window": 128, "tie_word_embeddings": False, "hidden_act": "silu",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "attention_bias": True,
}
"""``transformers.GptOssConfig``'s defaults of the fields the kit reads (used for a key
absent from ``config.json``; a JSON ``null`` keeps its own meaning)."""

_DEFAULT_ROPE: Mapping[str, Any] = {
    "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
    "original_max_position_embeddings": 4096,
}
_DEFAULT_THETA = 150000.0
_LAYER_TYPES = ("sliding_attention", "full_attention")


def gpt_oss_hf_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a gpt-oss ``config.json`` dict with transformers' defaults filled in.

    Called by ``ModelConfig.from_hf_config`` before it parses a gpt-oss config. Fills
    absent keys from :data:`GPT_OSS_DEFAULTS`; ``layer_types`` (absent or ``null``)
    alternating ``sliding_attention`` / ``full_attention`` from layer 0; the YaRN
    ``rope_parameters`` of ``GptOssConfig`` when neither ``rope_parameters`` nor
    ``rope_scaling`` is given; ``rope_theta`` 150000 when no theta is given. Mutates
    nothing.

    Raises:
        ConfigError: a ``quantization_config`` (MXFP4 checkpoints: the kit loads
            unquantized weights only) or a bad ``layer_types`` (named).
    """
    if config.get("quantization_config") is not None:
        method = config["quantization_config"]
        method = method.get("quant_method", method) if isinstance(method, Mapping) else method
        raise ConfigError(
            f"quantization_config must be absent (the kit loads unquantized bf16/fp16/fp32 "
            f"gpt-oss weights only), got quant_method {method!r}")
    filled = dict(config)
    for key, value in GPT_OSS_DEFAULTS.items():
        filled.setdefault(key, value)
    layers = as_int(filled, "num_hidden_layers")
    if filled.get("layer_types") is None:
        filled["layer_types"] = [_LAYER_TYPES[i % 2] for i in range(layers)]
    params = filled.get("rope_parameters") or filled.get("rope_scaling")
    if not params:
        filled["rope_parameters"] = dict(_DEFAULT_ROPE)
        params = filled["rope_parameters"]
    if filled.get("rope_theta") is None and (not isinstance(params, Mapping) or params.get("rope_theta") is None):
        filled["rope_theta"] = _DEFAULT_THETA
    return filled


def layer_type_windows(config: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Per layer, ``sliding_window`` for a ``sliding_attention`` entry of ``layer_types``
    and ``None`` for ``full_attention``; ``()`` (every layer full) when ``sliding_window``
    is ``null``. Pure.

    Raises:
        ConfigError: ``layer_types`` is not a list of ``num_layers`` of those two names,
            or ``sliding_window`` is not an int.
    """
    types = config.get("layer_types")
    if not isinstance(types, list) or len(types) != num_layers or any(t not in _LAYER_TYPES for t in types):
        raise ConfigError(
            f"layer_types must list {num_layers} of {list(_LAYER_TYPES)}, got {types!r}")
    if config.get("sliding_window") is None:
        return ()
    window = as_int(config, "sliding_window")
    return tuple(window if t == "sliding_attention" else None for t in types)
