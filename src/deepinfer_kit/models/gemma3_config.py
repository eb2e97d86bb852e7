"""Gemma 3 text (``gemma3_text``): the ``config.json`` fields that differ from the other
families, read into :class:`ModelConfig` flags once.

What transformers' ``Gemma3TextConfig`` / ``modeling_gemma3`` define, and where it lands:
``layer_types`` (or the older ``sliding_window_pattern``: every ``n``-th layer global) and
``sliding_window`` -> ``sliding_windows``; ``rope_parameters`` keyed by layer type (or the
4.x ``rope_theta`` + ``rope_scaling`` for the global layers, ``rope_local_base_freq`` for
the local ones) -> ``rope`` and ``local_rope``; ``query_pre_attn_scalar ** -0.5`` ->
``attn_scale``; ``sqrt(hidden_size)`` -> ``embed_scale``; ``(1 + weight)`` norms, sandwich
norms and ``hidden_activation`` -> ``norm_offset``, ``sandwich_norms``, ``hidden_act``.
Logit soft-capping and bidirectional attention are refused (``ConfigError``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.config_parts import RopeConfig, as_bool, as_float, as_int, parse_rope

__all__ = ["gemma3_fields", "GEMMA3_TEXT"]

GEMMA3_TEXT = "gemma3_text"
"""The ``model_type`` this module reads."""

_LAYER_TYPES = ("sliding_attention", "full_attention")
# transformers' Gemma3TextConfig.default_theta: the base when a layer type names none.
_DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
_THETA_KEY = {"full_attention": "rope_theta", "sliding_attention": "rope_local_base_freq"}


def gemma3_fields(config: Mapping[str, Any], *, hidden_size: int, head_dim: int,
                  num_layers: int, max_pos: int) -> dict[str, Any]:
    """The :class:`ModelConfig` keyword arguments of a ``gemma3_text`` config that differ from
    the generic parse: ``rope``, ``local_rope``, ``sliding_windows``, ``attn_scale``,
    ``embed_scale``, ``hidden_act``, ``norm_offset``, ``sandwich_norms``, ``qk_norm``,
    ``o_bias`` (Gemma's ``attention_bias`` covers ``o_proj`` too).

    Called once by :meth:`ModelConfig.from_hf_config`.

    Raises:
        ConfigError: naming the field and value: a soft-capping value that is set
            (``final_logit_softcapping``, ``attn_logit_softcapping``: not implemented),
            ``use_bidirectional_attention``, a ``hidden_activation`` other than
            ``gelu_pytorch_tanh``, bad ``layer_types`` / ``sliding_window_pattern`` /
            ``sliding_window`` / ``query_pre_attn_scalar``, a flat or unsupported
            ``rope_parameters`` or a ``partial_rotary_factor`` other than 1.
    """
    for field in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.get(field) is not None:
            raise ConfigError(f"{field} is not supported for {GEMMA3_TEXT} (logit soft-capping is "
                              f"not implemented), got {config[field]!r}")
    if as_bool(config, "use_bidirectional_attention", False):
        raise ConfigError(f"use_bidirectional_attention is not supported for {GEMMA3_TEXT} "
                          f"(causal decoding only), got True")
    act = config.get("hidden_activation") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"hidden_activation must be 'gelu_pytorch_tanh' for {GEMMA3_TEXT}, got {act!r}")
    scalar = as_float(config, "query_pre_attn_scalar", 256)
    if not scalar > 0:
        raise ConfigError(f"query_pre_attn_scalar must be > 0, got {config['query_pre_attn_scalar']!r}")
    window = as_int(config, "sliding_window", 4096)
    if window < 1:
        raise ConfigError(f"sliding_window must be >= 1, got {window}")
    types = _layer_types(config, num_layers)
    ropes = _ropes(config, head_dim, max_pos)
    return {
        "rope": ropes["full_attention"],
        "local_rope": ropes["sliding_attention"],
        "sliding_windows": tuple(window if t == "sliding_attention" else None for t in types),
        "attn_scale": scalar**-0.5,
        "embed_scale": hidden_size**0.5,
        "hidden_act": act,
        "norm_offset": True,
        "sandwich_norms": True,
        "qk_norm": True,
        "o_bias": as_bool(config, "attention_bias", False),
    }


def _layer_types(config: Mapping[str, Any], num_layers: int) -> list[str]:
    """``layer_types``, or the older ``sliding_window_pattern`` (layer ``i`` global when
    ``(i + 1) % pattern == 0``; transformers' default pattern is 6)."""
    types = config.get("layer_types")
    if types is None:
        pattern = as_int(config, "sliding_window_pattern", 6)
        if pattern < 1:
            raise ConfigError(f"sliding_window_pattern must be >= 1, got {pattern}")
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if (not isinstance(types, list) or len(types) != num_layers
            or any(t not in _LAYER_TYPES for t in types)):
        raise ConfigError(f"layer_types must be a list of num_layers={num_layers} entries from "
                          f"{list(_LAYER_TYPES)}, got {types!r}")
    return list(types)


def _ropes(config: Mapping[str, Any], head_dim: int, max_pos: int) -> dict[str, RopeConfig]:
    """The RoPE of each layer type, as transformers' ``convert_rope_params_to_dict`` builds
    them: ``rope_parameters[type]``, a 4.x ``rope_scaling`` merged into the global type's,
    the base from the entry, else ``rope_theta`` / ``rope_local_base_freq``, else the
    family default (1e6 global, 1e4 local)."""
    params = config.get("rope_parameters")
    if params is not None and not isinstance(params, Mapping):
        raise ConfigError(f"rope_parameters must be a mapping, got {params!r}")
    params = params or {}
    if params and not any(t in params for t in _LAYER_TYPES):
        raise ConfigError(f"rope_parameters of {GEMMA3_TEXT} must be keyed by layer type "
                          f"{list(_LAYER_TYPES)}, got {dict(params)!r}")
    ropes = {}
    for layer_type in _LAYER_TYPES:
        entry = params.get(layer_type)
        if entry is not None and not isinstance(entry, Mapping):
            raise ConfigError(f"rope_parameters[{layer_type!r}] must be a mapping, got {entry!r}")
        merged = dict(entry) if entry is not None else {"rope_type": "default"}
        scaling = config.get("rope_scaling")
        if layer_type == "full_attention" and scaling is not None:
            if not isinstance(scaling, Mapping):
                raise ConfigError(f"rope_scaling must be a mapping, got {scaling!r}")
            merged.update(scaling)
        merged.setdefault("rope_type", merged.get("type", "default"))
        if merged.get("type", merged["rope_type"]) != merged["rope_type"]:
            # transformers runs rope_type and ignores the 4.x alias: refuse rather than guess.
            raise ConfigError(f"the {layer_type} RoPE has rope_type {merged['rope_type']!r} and type "
                              f"{merged['type']!r}; write one rope_type (e.g. in rope_scaling)")
        if merged.get("rope_theta") is None:
            merged["rope_theta"] = as_float(config, _THETA_KEY[layer_type], _DEFAULT_THETA[layer_type])
        partial = merged.get("partial_rotary_factor", config.get("partial_rotary_factor"))
        if partial is not None and partial != 1:
            raise ConfigError(f"partial_rotary_factor is not supported for {GEMMA3_TEXT}, got {partial!r}")
        ropes[layer_type] = parse_rope({"rope_parameters": merged, "max_position_embeddings": max_pos},
                                       GEMMA3_TEXT, head_dim, max_pos)
    return ropes
