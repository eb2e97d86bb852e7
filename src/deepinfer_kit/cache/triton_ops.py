# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Triton kernels of the KV pool: slot-mapped K/V write and whole-block copy.

Same signatures and semantics as ``ref_ops.py`` (the spec). Imported only when a
``PagedKVCache`` is built with the Triton implementation, so ``import deepinfer_kit``
never imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["write_kv", "copy_blocks"]

_COPY_CHUNK = 1024


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    k_s0, k_s1, k_s2, v_s0, v_s1, v_s2,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HEADS * HEAD_DIM
    h = offs // HEAD_DIM
    d = offs % HEAD_DIM
    row = t.to(tl.int64)
    k = tl.load(key_ptr + row * k_s0 + h * k_s1 + d * k_s2, mask=mask)
    v = tl.load(value_ptr + row * v_s0 + h * v_s1 + d * v_s2, mask=mask)
    dst = slot * (HEADS * HEAD_DIM) + offs
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store token ``i``'s K/V at slot ``slot_mapping[i]``; see ``ref_ops.write_kv``.

    One program per token copies its ``Hkv * D`` values (any strides of ``key``/``value``).
    """
    num_tokens, heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        HEADS=heads, HEAD_DIM=head_dim, BLOCK=triton.next_power_of_2(heads * head_dim),
    )  # fmt: skip


# the ids are one staged buffer: dst starts len(src) * 8 bytes in, 16-byte aligned or not
@triton.jit(do_not_specialize_on_alignment=["src_ptr", "dst_ptr"])
def _copy_blocks_kernel(
    kv_ptr, src_ptr, dst_ptr, num_blocks,
    BLOCK_NUMEL: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)  # layer * 2 + (0 for K, 1 for V)
    chunk = tl.program_id(2)
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_NUMEL
    base = plane * num_blocks * BLOCK_NUMEL
    vals = tl.load(kv_ptr + base + src * BLOCK_NUMEL + offs, mask=mask)
    tl.store(kv_ptr + base + dst * BLOCK_NUMEL + offs, vals, mask=mask)


def copy_blocks(kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy block ``src[c]`` to ``dst[c]`` in every layer, K and V; see ``ref_ops.copy_blocks``.

    ``kv`` is the contiguous ``[L, 2, NB, P, Hkv, D]`` pool; one program per (copy, layer
    plane, chunk of the block).
    """
    if src.numel() == 0:
        return
    layers, _, num_blocks = kv.shape[:3]
    block_numel = kv[0, 0, 0].numel()
    chunk = min(_COPY_CHUNK, triton.next_power_of_2(block_numel))
    grid = (src.numel(), layers * 2, triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](kv, src, dst, num_blocks, BLOCK_NUMEL=block_numel, CHUNK=chunk)
