"""The fused q/k RMSNorm + RoPE + KV-cache write of one attention layer: its torch reference
(the spec and test oracle of ``rope_kv_triton``) and which model configs the kernel serves.

The reference is the unfused layer's own ops composed: ``fused_ops.rms_norm`` over the
``Hq + Hkv`` query and key heads, ``rope.apply_rotary``, then ``cache.ref_ops.write_kv``
of the keys and values. Shape symbols: ``T`` tokens, ``Hq`` query heads, ``Hkv`` KV heads,
``D`` head dim, ``rot`` rotary dims, ``S`` slots of the layer's cache (``(NB + 1) * P``,
the scratch block of ``pad_slot`` included).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer_kit.cache.ref_ops import write_kv
from deepinfer_kit.models.config import ModelConfig
from deepinfer_kit.models.fused_ops import rms_norm
from deepinfer_kit.models.rope import apply_rotary

__all__ = ["RopeKvOp", "rope_kv_write", "rope_kv_unsupported", "MAX_HEAD_DIM"]

RopeKvOp = Callable[
    [torch.Tensor, torch.Tensor | None, float, torch.Tensor, torch.Tensor, torch.Tensor,
     torch.Tensor, torch.Tensor, int],
    torch.Tensor,
]
"""``op(qkv, norm_weight, eps, cos, signed_sin, key_cache, value_cache, slot_mapping,
num_heads) -> q``; see :func:`rope_kv_write`."""

MAX_HEAD_DIM = 512
"""The kernel holds one head in registers; wider heads take the unfused path."""


def rope_kv_write(
    qkv: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:
    """Norm (optional) and rotate the step's queries and keys; store keys and values by slot.

    Called by ``PagedSelfAttention.forward`` once per layer and step (the Triton kernel; this
    reference is its oracle and has the unfused layer's numerics).

    Args:
        qkv: ``[T, (Hq + 2 Hkv) D]`` the fused projection output (queries, keys, values),
            float32/bfloat16/float16; the last dim contiguous.
        norm_weight: ``[Hq + Hkv, D]`` the q-norm weight repeated over the query heads then
            the k-norm weight over the KV heads, same dtype and device; ``None``: no norm.
        eps: added to the mean square of the norm.
        cos, signed_sin: ``[T, 1, rot]`` from ``RotaryEmbedding.cos_sin`` in ``qkv.dtype``.
        key_cache, value_cache: ``[S / P, P, Hkv, D]`` contiguous, the layer's whole cache
            including the scratch block; mutated: row ``slot_mapping[t]`` gets token ``t``'s
            rotated key / value (cast to the cache dtype).
        slot_mapping: ``[T]`` int64 slots in ``[0, S)``; distinct except the pad slot,
            which may repeat (its contents are then unspecified).
        num_heads: ``Hq``.

    Returns:
        ``[T, Hq, D]`` the rotated (normed) queries in ``qkv.dtype`` (may be a view of a
        temporary). ``qkv`` is not mutated.
    """
    tokens = qkv.shape[0]
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    qk_width = (num_heads + num_kv_heads) * head_dim
    qk = qkv[:, :qk_width].view(tokens, num_heads + num_kv_heads, head_dim)
    value = qkv[:, qk_width:].view(tokens, num_kv_heads, head_dim)
    if norm_weight is not None:
        qk = rms_norm(qk, norm_weight, eps)
    qk = apply_rotary(qk, cos, signed_sin)
    write_kv(key_cache, value_cache, qk[:, num_heads:], value, slot_mapping)
    return qk[:, :num_heads]


def rope_kv_unsupported(config: ModelConfig) -> str | None:
    """Why the fused kernel cannot serve ``config`` (``None``: it can).

    Called once at model construction; the layers of an unsupported model take the unfused
    path (norm, rotate, ``PagedKVStore.write``). The kernel covers the "rotate half" layout
    of every RoPE scaling variant (they differ only in ``cos``/``sin``), partial rotary,
    per-head q/k norm or none, and any ``D`` up to :data:`MAX_HEAD_DIM`; not Gemma 3's
    ``(1 + weight)`` q/k norm (``config.norm_offset``).
    """
    if config.norm_offset:
        return "the q/k norms scale by (1 + weight) (norm_offset); the kernel multiplies by weight"
    if config.head_dim > MAX_HEAD_DIM:
        return f"head_dim {config.head_dim} > {MAX_HEAD_DIM}"
    rot = config.rope.rotary_dim
    if rot % 2 or rot > config.head_dim:
        return f"rotary_dim {rot} is odd or larger than head_dim {config.head_dim}"
    return None
