# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Triton kernel of the fused q/k RMSNorm + RoPE + KV-cache write: one launch per layer
instead of a norm, a rotation and a cache write.

Same signature and numerics as ``rope_kv.rope_kv_write`` (the spec): the norm in fp32 with
the normalized value rounded to the input dtype before the weight multiply, then each
rotary product and their sum rounded to the input dtype, as the unfused torch ops do. One
program per (token, head) of the ``Hq + Hkv`` query and key heads; a key head's program
also copies the matching value head. ``T`` is only the grid's size and strides are runtime
arguments, so a new batch size reuses the compiled kernel; the head layout, ``rot`` and the
norm switch are ``tl.constexpr``. Imported only when ``select_fused_ops`` chooses Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rope_kv_write"]


@triton.jit
def _normed(x_ptr, w_ptr, cols, ok, rstd, HAS_NORM: tl.constexpr, DTYPE: tl.constexpr):
    """The head's values at ``cols`` after the (optional) norm, in DTYPE."""
    x = tl.load(x_ptr + cols, mask=ok, other=0.0)
    if HAS_NORM:
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        x = ((x.to(tl.float32) * rstd).to(DTYPE).to(tl.float32) * w).to(DTYPE)
    return x


@triton.jit
def _rope_kv_kernel(
    qkv_ptr, w_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr, slot_ptr,
    qkv_stride, cos_stride, sin_stride, q_stride, eps,
    NUM_HQ: tl.constexpr, NUM_HKV: tl.constexpr, HEAD_DIM: tl.constexpr, ROT: tl.constexpr,
    HAS_NORM: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dtype = q_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_D)
    ok = cols < HEAD_DIM
    x_ptr = qkv_ptr + t * qkv_stride + head * HEAD_DIM
    w_ptr = w_ptr + head * HEAD_DIM
    rstd = 0.0
    if HAS_NORM:
        xf = tl.load(x_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, 0) / HEAD_DIM + eps)
    x = _normed(x_ptr, w_ptr, cols, ok, rstd, HAS_NORM, dtype).to(tl.float32)
    in_rot = cols < ROT
    partner = tl.where(cols < ROT // 2, cols + ROT // 2, cols - ROT // 2)
    xp = _normed(x_ptr, w_ptr, partner, in_rot, rstd, HAS_NORM, dtype).to(tl.float32)
    c = tl.load(cos_ptr + t * cos_stride + cols, mask=in_rot, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + t * sin_stride + cols, mask=in_rot, other=0.0).to(tl.float32)
    rotated = ((x * c).to(dtype).to(tl.float32) + (xp * s).to(dtype).to(tl.float32)).to(dtype)
    out = tl.where(in_rot, rotated, x.to(dtype))
    if head < NUM_HQ:
        tl.store(q_ptr + t * q_stride + head * HEAD_DIM + cols, out, mask=ok)
    else:
        kv_head = head - NUM_HQ
        slot = tl.load(slot_ptr + t).to(tl.int64)
        dst = slot * (NUM_HKV * HEAD_DIM) + kv_head * HEAD_DIM + cols
        tl.store(kc_ptr + dst, out.to(kc_ptr.dtype.element_ty), mask=ok)
        v = tl.load(x_ptr + NUM_HKV * HEAD_DIM + cols, mask=ok, other=0.0)
        tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=ok)


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
    """Norm, rotate and store by slot in one launch; see ``rope_kv.rope_kv_write``.

    All tensors on CUDA (or the CPU under the interpreter). ``T`` may be 0.

    Returns:
        A new contiguous ``[T, Hq, D]`` tensor of rotated queries in ``qkv.dtype``.

    Raises:
        ValueError: the shapes disagree (``qkv`` width, weight, cos/sin or slot mapping).
    """
    tokens = qkv.shape[0]
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    heads = num_heads + num_kv_heads
    rot = cos.shape[-1]
    bad_weight = norm_weight is not None and norm_weight.shape != (heads, head_dim)
    if (qkv.dim() != 2 or qkv.shape[1] != (heads + num_kv_heads) * head_dim or bad_weight
            or cos.shape != signed_sin.shape or cos.shape[0] != tokens or rot > head_dim
            or slot_mapping.shape != (tokens,) or not key_cache.is_contiguous()
            or value_cache.shape != key_cache.shape or not value_cache.is_contiguous()):
        raise ValueError(
            f"rope_kv_write: shapes disagree: qkv {list(qkv.shape)}, num_heads {num_heads}, "
            f"cache {list(key_cache.shape)}, cos {list(cos.shape)}, sin {list(signed_sin.shape)}, "
            f"slot_mapping {list(slot_mapping.shape)}, norm_weight "
            f"{None if norm_weight is None else list(norm_weight.shape)}")
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    cos = cos.reshape(tokens, rot).contiguous()
    signed_sin = signed_sin.reshape(tokens, rot).contiguous()
    q = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    _rope_kv_kernel[(tokens, heads)](
        qkv, qkv if norm_weight is None else norm_weight, cos, signed_sin, q,
        key_cache, value_cache, slot_mapping,
        qkv.stride(0), cos.stride(0), signed_sin.stride(0), q.stride(0), eps,
        NUM_HQ=num_heads, NUM_HKV=num_kv_heads, HEAD_DIM=head_dim, ROT=rot,
        HAS_NORM=norm_weight is not None, BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
    return q
