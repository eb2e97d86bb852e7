# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Triton helpers every per-row sampling kernel shares: a row's finite maximum, its start
(index, base pointer, ``1 / T``, min-p), a chunk's weights and the row's float64 total
(chunk sums in float32, as ``ref_ops``' blocked sums)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["row_max", "row_start", "chunk_weights", "row_total"]


@triton.jit
def row_max(base, V, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, V, BLOCK):
        v = tl.load(base + start + offs, mask=start + offs < V, other=float("-inf"))
        m = tl.maximum(m, v)
    top = tl.max(m, axis=0)
    return tl.where(top == float("-inf"), 0.0, top)


@triton.jit
def row_start(x_ptr, rows_ptr, inv_t_ptr, min_p_ptr, stride, V, BLOCK: tl.constexpr):
    """This program's row: its index, base pointer, ``1 / T``, min-p and finite maximum."""
    pid = tl.program_id(0)
    base = x_ptr + tl.load(rows_ptr + pid).to(tl.int64) * stride
    return pid, base, tl.load(inv_t_ptr + pid), tl.load(min_p_ptr + pid), row_max(base, V, BLOCK)


@triton.jit
def chunk_weights(base, start, V, top, inv_t, min_p, BLOCK: tl.constexpr):
    offs = start + tl.arange(0, BLOCK)
    v = tl.load(base + offs, mask=offs < V, other=float("-inf"))
    w = tl.exp((v - top) * inv_t)
    return tl.where(w < min_p, 0.0, w)


@triton.jit
def row_total(base, V, top, inv_t, min_p, BLOCK: tl.constexpr):
    """float64 sum of the row's weights, chunk sums in float32 (as ``ref_ops._block_sums``)."""
    total = tl.sum(tl.zeros([BLOCK], tl.float64), axis=0)
    for start in range(0, V, BLOCK):
        w = chunk_weights(base, start, V, top, inv_t, min_p, BLOCK)
        total += tl.sum(w, axis=0).to(tl.float64)
    return total
