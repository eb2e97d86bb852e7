"""DeepSeek-V3 multi-head latent attention (MLA): its ``config.json`` fields, the softmax
scale they imply, and the row a token leaves in the KV pool.

What transformers' ``DeepseekV3Config`` / ``modeling_deepseek_v3`` define: queries through
``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj`` (``q_lora_rank``) or one ``q_proj``
(``q_lora_rank`` null), ``qk_nope_head_dim`` + ``qk_rope_head_dim`` per head; keys and
values from one latent of ``kv_lora_rank`` plus one shared rotary key of
``qk_rope_head_dim`` (``kv_a_proj_with_mqa``), expanded per head by ``kv_b_proj`` into
``qk_nope_head_dim`` key and ``v_head_dim`` value dims. Read once by
:meth:`~deepinfer_kit.models.config.ModelConfig.from_hf_config`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from deepinfer_kit._validators import int_at_least
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.config_parts import RopeConfig, as_bool, as_int, as_optional_int

__all__ = ["MLAConfig", "CacheRow", "parse_mla", "MLA_MODEL_TYPES"]

MLA_MODEL_TYPES = ("deepseek_v3",)
"""``model_type`` values whose attention is MLA."""

LATENT_NORM_EPS = 1e-6
"""Epsilon of ``q_a_layernorm`` and ``kv_a_layernorm``: transformers builds both with the
RMSNorm default, not ``rms_norm_eps``."""


@attrs.frozen(slots=True)
class CacheRow:
    """What one token of one layer stores in the paged KV pool.

    Attributes:
        num_heads: heads per row (``Hkv``; 1 for the MLA latent).
        head_dim: dims per head (``D``).
        keys_only: one tensor per token (the MLA latent row) instead of a key and a value
            (``PagedKVCache(..., keys_only=True)``).
    """

    num_heads: int
    head_dim: int
    keys_only: bool = False


@attrs.frozen(slots=True)
class MLAConfig:
    """The latent attention of every layer of a DeepSeek-V3 checkpoint.

    Attributes:
        q_lora_rank: rank of the query down-projection, ``None`` for one ``q_proj``.
        kv_lora_rank: ``C``, the latent each token caches.
        qk_nope_head_dim: ``dn``, per-head query/key dims without RoPE.
        qk_rope_head_dim: ``dr``, per-head query dims with RoPE (and the shared rotary key).
        v_head_dim: ``dv``, per-head value dims.
        rope_interleave: the checkpoint's rotary dims are interleaved pairs ``(x0, x1),
            (x2, x3), ...`` (transformers' ``rope_interleave``; the loader de-interleaves
            the projection rows once, so the layer rotates in the "rotate half" layout).
        attention_bias: ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` carry biases.

    Raises:
        ConfigError: a size is not an int >= 1 (named), or ``qk_rope_head_dim`` is odd.
    """

    q_lora_rank: int | None
    kv_lora_rank: int = attrs.field(validator=int_at_least(1))
    qk_nope_head_dim: int = attrs.field(validator=int_at_least(1))
    qk_rope_head_dim: int = attrs.field(validator=int_at_least(2))
    v_head_dim: int = attrs.field(validator=int_at_least(1))
    rope_interleave: bool = True
    attention_bias: bool = False

    def __attrs_post_init__(self) -> None:
        if self.q_lora_rank is not None:
            int_at_least(1)(self, attrs.fields(MLAConfig).q_lora_rank, self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        """``dn + dr``: the per-head width of a query and an expanded key."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_row(self) -> int:
        """``C + dr``: the cached row of one token (normalized latent, then rotated key)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def cache_row(self) -> CacheRow:
        """The pool row of one token and layer: one head of :attr:`latent_row`, keys only."""
        return CacheRow(num_heads=1, head_dim=self.latent_row, keys_only=True)

    def softmax_scale(self, rope: RopeConfig) -> float:
        """``qk_head_dim ** -0.5``, times ``mscale ** 2`` when the RoPE is scaled and
        ``mscale_all_dim`` is set, ``mscale = 0.1 * mscale_all_dim * ln(factor) + 1``
        (``1`` for ``factor <= 1``): YaRN's attention temperature applied to every dim, as
        transformers' ``yarn_apply_mscale`` does for any non-default ``rope_type``."""
        scale: float = self.qk_head_dim ** -0.5
        if rope.rope_type != "default" and rope.mscale_all_dim:
            mscale = 1.0 if rope.factor <= 1 else 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
            scale *= mscale * mscale
        return scale


def parse_mla(config: Mapping[str, Any], model_type: str) -> MLAConfig | None:
    """The :class:`MLAConfig` of a ``config.json`` dict, ``None`` unless ``model_type`` is
    one of :data:`MLA_MODEL_TYPES`.

    Raises:
        ConfigError: a missing or invalid MLA field (named with its value).
    """
    if model_type not in MLA_MODEL_TYPES:
        return None
    return MLAConfig(
        q_lora_rank=as_optional_int(config, "q_lora_rank"),
        kv_lora_rank=as_int(config, "kv_lora_rank"),
        qk_nope_head_dim=as_int(config, "qk_nope_head_dim"),
        qk_rope_head_dim=as_int(config, "qk_rope_head_dim"),
        # transformers' DeepseekV3Config allows a null v_head_dim; the modeling then fails.
        v_head_dim=as_int(config, "v_head_dim"),
        rope_interleave=as_bool(config, "rope_interleave", True),
        attention_bias=as_bool(config, "attention_bias", False),
    )
