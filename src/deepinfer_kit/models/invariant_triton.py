# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Batch-invariant Triton GEMM: ``x W^T (+ b)`` whose every output row is bitwise the same
at any row count, in any place, beside any other rows.

The CUDA matmul of the batch-invariant mode (``invariant.select_linear_op``), the twin of
``invariant.invariant_linear`` (same signature and contract; its torch reference). A
cuBLAS GEMM picks its kernel, tiles and split-K from the problem's shape, so a row's sum
changes with the row count; here every program computes one ``[BLOCK_M, BLOCK_N]`` output
tile with tiles fixed by the dtype only (:func:`tile_config`), walks ``K`` in
``BLOCK_K`` steps in order from 0 with an fp32 accumulator (fp32 operands in IEEE
precision, no TF32), never splits ``K``, and adds the bias after the loop. A row's
result then depends on its own values and the weights only. The row count is a runtime
argument that is never specialized, so one compiled kernel serves every ``T``.

Imported only by ``invariant.select_linear_op`` on CUDA (``import deepinfer_kit`` never
imports Triton); also runs under ``TRITON_INTERPRET=1`` on CPU tensors.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["linear", "tile_config"]


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Program ``(n_tile, m_tile)``: ``out[rows, cols] = sum_k x[rows, k] w[cols, k] (+ b)``,
    ``K`` in ``BLOCK_K`` steps from 0, edges masked with zeros."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    col_ok = cols < N
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + ks[None, :] * stride_xk,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols64[None, :] * stride_wn + ks[:, None] * stride_wk,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows64[:, None] * stride_om + cols64[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def tile_config(dtype: torch.dtype) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps)`` of :func:`linear` for operands of
    ``dtype``: fp32 (an FMA dot in IEEE precision) 32 x 64 tiles over 32-deep steps,
    16-bit floats (tensor cores) 64 x 64 over 64-deep steps; 4 warps. A function of the
    dtype only, never of the row count (what makes the GEMM batch-invariant). Asked by
    :func:`linear` at every call; pure."""
    if dtype == torch.float32:
        return 32, 64, 32, 4
    return 64, 64, 64, 4


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T (+ b)`` with each row's result independent of the other rows and their
    count (the module docstring says how); same contract as ``invariant.invariant_linear``.

    Called at every matmul site of a model built with ``batch_invariant=True`` on CUDA
    (``Linear.op``, the LM head, the MoE routers). Mutates nothing.

    Args:
        x: ``[T, K]`` (``T >= 0``, any strides), float32 / bfloat16 / float16, on CUDA
            (or the CPU under ``TRITON_INTERPRET=1``).
        weight: ``[N, K]`` (any strides), same dtype and device.
        bias: ``[N]`` or ``None``, same device (added in fp32 after the sum).

    Returns:
        A new contiguous ``[T, N]`` tensor in ``x.dtype``: fp32 accumulation, rounded once.

    Raises:
        ValueError: the shapes or dtypes disagree.
    """
    if (x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1] or x.dtype != weight.dtype
            or (bias is not None and bias.shape != (weight.shape[0],))):
        raise ValueError(
            f"invariant linear: expected x [T, K], weight [N, K] of one dtype and bias [N] or "
            f"None, got x {list(x.shape)} {x.dtype}, weight {list(weight.shape)} {weight.dtype}, "
            f"bias {None if bias is None else list(bias.shape)}")
    rows, depth = x.shape
    cols = weight.shape[0]
    out = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    if rows == 0 or cols == 0:
        return out
    block_m, block_n, block_k, warps = tile_config(x.dtype)
    grid = (triton.cdiv(cols, block_n), triton.cdiv(rows, block_m))
    _linear_kernel[grid](
        x, weight, bias if bias is not None else out, out, rows, cols, depth,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        # The interpreter's tl.dot on 16-bit floats returns garbage (triton 3.9): upcast there.
        UPCAST=x.dtype != torch.float32 and os.environ.get("TRITON_INTERPRET") == "1",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
    )  # fmt: skip
    return out
