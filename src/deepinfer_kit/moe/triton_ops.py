# mypy: disable-error-code="untyped-decorator, no-untyped-def"
"""Triton grouped-GEMM SwiGLU experts (same signature as ``ref_ops.grouped_swiglu``).

Imported only when ``impl="triton"`` is chosen. One kernel, a grouped ``y = x W_e^T`` over
expert-contiguous rows, runs twice: first with a SwiGLU epilogue over the fused
``[2I, H]`` gate/up weights, then plain for the ``[H, I]`` down weights. The host builds a
table of row tiles (expert, first row, end row) from the per-expert counts, so each program
computes one ``BLOCK_M x BLOCK_N`` tile of one expert and empty experts cost nothing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

__all__ = ["grouped_swiglu", "tile_table"]


@triton.jit
def _dot(x, w, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + x @ w``; fp32 operands in IEEE precision (no TF32) when ``IEEE``."""
    if UPCAST:
        x = x.to(tl.float32)
        w = w.to(tl.float32)
    if IEEE:
        return tl.dot(x, w, acc, input_precision="ieee")
    return tl.dot(x, w, acc)


@triton.jit
def _grouped_linear_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    tile_expert_ptr,
    tile_start_ptr,
    tile_end_ptr,
    K,
    N,
    stride_xm,
    stride_we,
    stride_wn,
    stride_om,
    SWIGLU: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    start = tl.load(tile_start_ptr + pid_m)
    end = tl.load(tile_end_ptr + pid_m)
    rows = start + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < end
    col_ok = cols < N
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(
            x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w_mask = k_ok[:, None] & col_ok[None, :]
        w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        acc = _dot(x, w, acc, IEEE, UPCAST)
        if SWIGLU:
            w_up = tl.load(
                w_base + (cols[None, :] + N) * stride_wn + ks[:, None], mask=w_mask, other=0.0
            )
            acc_up = _dot(x, w_up, acc_up, IEEE, UPCAST)
    if SWIGLU:
        acc = acc * tl.sigmoid(acc) * acc_up
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def tile_table(counts: Sequence[int], block_m: int, device: torch.device) -> torch.Tensor:
    """``[3, n_tiles]`` int32 (expert, first row, end row) of every ``block_m`` row tile."""
    experts: list[int] = []
    starts: list[int] = []
    ends: list[int] = []
    offset = 0
    for expert, count in enumerate(counts):
        end = offset + count
        for first in range(offset, end, block_m):
            experts.append(expert)
            starts.append(first)
            ends.append(end)
        offset = end
    return torch.tensor([experts, starts, ends], dtype=torch.int32, device=device)


def _grouped_linear(
    x: torch.Tensor, w: torch.Tensor, tiles: torch.Tensor, n_out: int, swiglu: bool, block_m: int
) -> torch.Tensor:
    out = torch.empty(x.shape[0], n_out, dtype=x.dtype, device=x.device)
    n_tiles = tiles.shape[1]
    if n_tiles == 0:
        return out
    block_n = 32
    grid = (n_tiles, triton.cdiv(n_out, block_n))
    _grouped_linear_kernel[grid](
        x,
        w,
        out,
        tiles[0],
        tiles[1],
        tiles[2],
        x.shape[1],
        n_out,
        x.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        SWIGLU=swiglu,
        IEEE=x.dtype == torch.float32,
        # The interpreter's tl.dot on 16-bit floats returns garbage (triton 3.9): upcast there.
        UPCAST=x.dtype != torch.float32 and os.environ.get("TRITON_INTERPRET") == "1",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=32,
    )
    return out


def grouped_swiglu(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    counts: Sequence[int],
) -> torch.Tensor:
    """SwiGLU experts over expert-contiguous rows: ``ref_ops.grouped_swiglu`` on Triton.

    Same arguments and result (``x [M, H]``, ``gate_up [E, 2I, H]``, ``down [E, H, I]``,
    ``counts``: ``E`` host ints -> ``[M, H]`` in the dtype of ``x``); fp32 accumulation.
    """
    x = x.contiguous()
    gate_up = gate_up.contiguous()
    down = down.contiguous()
    block_m = 32
    tiles = tile_table(counts, block_m, x.device)
    act = _grouped_linear(x, gate_up, tiles, down.shape[2], True, block_m)
    return _grouped_linear(act, down, tiles, down.shape[1], False, block_m)
