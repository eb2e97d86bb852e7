"""RoPE parameters, the sparse-layer layout, and the typed readers of config.json fields."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from deepinfer_kit.errors import ConfigError

__all__ = [
    "RopeConfig", "parse_rope", "sparse_layer_indices",
    "as_int", "as_optional_int", "as_int_list", "as_float", "as_bool",
]

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_MISSING = object()


def _value(config: Mapping[str, Any], key: str, default: Any) -> Any:
    """``config[key]``, with ``None`` (JSON ``null``) read as absent, like transformers."""
    value = config.get(key)
    value = default if value is None else value
    if value is _MISSING:
        raise ConfigError(f"config field {key} is missing")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def as_int(config: Mapping[str, Any], key: str, default: Any = _MISSING) -> int:
    """``config[key]`` as an int; ConfigError naming ``key`` when missing or not an int
    (a bool, a float such as ``16.0`` or a string such as ``"16"`` is refused)."""
    value = _value(config, key, default)
    if not _is_int(value):
        raise ConfigError(f"{key} must be an int, got {value!r} ({type(value).__name__})")
    return int(value)


def as_optional_int(config: Mapping[str, Any], key: str) -> int | None:
    """``config[key]`` as an int, or ``None`` when absent or ``null``."""
    return None if config.get(key) is None else as_int(config, key)


def as_int_list(config: Mapping[str, Any], key: str) -> list[int]:
    """``config[key]`` as a list of ints (absent or ``null``: empty)."""
    value = _value(config, key, [])
    if not isinstance(value, list) or not all(_is_int(v) for v in value):
        raise ConfigError(f"{key} must be a list of ints, got {value!r} ({type(value).__name__})")
    return list(value)


def as_float(config: Mapping[str, Any], key: str, default: Any = _MISSING) -> float:
    """``config[key]`` as a float; ConfigError naming ``key`` when missing or not a number."""
    value = _value(config, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key} must be a number, got {value!r} ({type(value).__name__})")
    return float(value)


def as_bool(config: Mapping[str, Any], key: str, default: bool) -> bool:
    """``config[key]`` as a bool (``None`` reads as ``default``)."""
    value = _value(config, key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be a bool, got {value!r} ({type(value).__name__})")
    return value


@attrs.frozen(slots=True)
class RopeConfig:
    """Rotary position embedding parameters (the transformers ``rope_parameters`` meaning).

    Attributes:
        theta: base wavelength.
        rope_type: one of ``default``, ``linear``, ``llama3``, ``yarn``.
        rotary_dim: leading dims of each head that rotate (``head_dim * partial_rotary_factor``,
            even); the rest pass through.
        factor: context scaling factor (linear, llama3, yarn).
        original_max_position_embeddings: pre-scaling context (llama3, yarn).
        low_freq_factor: llama3 smoothing boundary.
        high_freq_factor: llama3 smoothing boundary.
        beta_fast: yarn extrapolation boundary (rotations).
        beta_slow: yarn interpolation boundary (rotations).
        mscale: yarn attention-factor numerator scale.
        mscale_all_dim: yarn attention-factor denominator scale.
        attention_factor: yarn cos/sin scale; ``None`` derives it from ``factor``.
        truncate: yarn rounds the correction range to whole dims.
    """

    theta: float
    rope_type: str = attrs.field(default="default")
    rotary_dim: int = 0
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @rope_type.validator
    def _check_type(self, attribute: attrs.Attribute[str], value: str) -> None:
        if value not in ROPE_TYPES:
            raise ConfigError(f"rope_type must be one of {list(ROPE_TYPES)}, got {value!r}")

    def __attrs_post_init__(self) -> None:
        if not self.theta > 0:
            raise ConfigError(f"rope_theta must be > 0, got {self.theta!r}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ConfigError(f"rotary_dim must be even and >= 2, got {self.rotary_dim}")
        if self.rope_type != "default" and not self.factor > 0:
            raise ConfigError(f"rope factor must be > 0, got {self.factor!r}")


def parse_rope(config: Mapping[str, Any], model_type: str, head_dim: int, max_pos: int) -> RopeConfig:
    """Read RoPE parameters from either ``rope_parameters`` (5.x) or ``rope_theta`` +
    ``rope_scaling`` (4.x). Raises ConfigError for unsupported types (``dynamic``, ...)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"rope_parameters must be a mapping, got {params!r}")
    if any(isinstance(v, Mapping) for v in params.values()):
        raise ConfigError(f"per-layer-type rope_parameters are not supported, got {dict(params)!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    # A field may sit in rope_parameters or (4.x) at the top level; both are type-checked.
    theta = as_float(params, "rope_theta", as_float(config, "rope_theta", 10000.0))
    default_partial = 0.5 if model_type == "glm4_moe" else 1.0
    partial = as_float(params, "partial_rotary_factor",
                       as_float(config, "partial_rotary_factor", default_partial))
    if not 0 < partial <= 1:
        raise ConfigError(f"partial_rotary_factor must be in (0, 1], got {partial}")
    original = as_int(params, "original_max_position_embeddings",
                      as_int(config, "original_max_position_embeddings", max_pos))
    factor = as_float(params, "factor", max_pos / original if rope_type == "yarn" else 1.0)

    def number(key: str, default: float | None) -> float | None:
        value = params.get(key)
        return default if value is None else as_float(params, key)

    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        rotary_dim=int(head_dim * partial),
        factor=factor,
        original_max_position_embeddings=original,
        low_freq_factor=number("low_freq_factor", 1.0) or 1.0,
        high_freq_factor=number("high_freq_factor", 4.0) or 4.0,
        # transformers treats 0 / None as "use the default" here.
        beta_fast=number("beta_fast", None) or 32.0,
        beta_slow=number("beta_slow", None) or 1.0,
        mscale=number("mscale", None),
        mscale_all_dim=number("mscale_all_dim", None),
        attention_factor=number("attention_factor", None),
        truncate=as_bool(params, "truncate", True),
    )


def sparse_layer_indices(config: Mapping[str, Any], model_type: str, num_layers: int) -> tuple[int, ...]:
    """Indices of the layers whose MLP is a mixture of experts (as transformers builds them).

    Qwen-MoE: not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``;
    Mixtral and gpt-oss: every layer; GLM-4-MoE and DeepSeek-V3: from ``first_k_dense_replace`` on (its
    default 1 and 3, as their transformers configs); dense families: none.
    """
    if model_type in ("qwen3_moe", "qwen2_moe"):
        key = "num_experts" if config.get("num_experts") is not None else "num_local_experts"
        experts = as_int(config, key, 0)
        dense_only = as_int_list(config, "mlp_only_layers")
        step = as_int(config, "decoder_sparse_step", 1)
        if step < 1:
            raise ConfigError(f"decoder_sparse_step must be >= 1, got {step}")
        return tuple(i for i in range(num_layers)
                     if i not in dense_only and experts > 0 and (i + 1) % step == 0)
    if model_type in ("mixtral", "gpt_oss"):
        return tuple(range(num_layers))
    if model_type in ("glm4_moe", "deepseek_v3"):
        first = as_int(config, "first_k_dense_replace", 1 if model_type == "glm4_moe" else 3)
        return tuple(range(max(first, 0), num_layers))
    return ()
