# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Triton kernels of the decoder's fused elementwise ops: RMSNorm, residual add + RMSNorm,
SiLU-and-mul.

Same signatures and numerics as ``fused_ops.py`` (the spec): fp32 arithmetic, the
normalized value rounded to the input dtype before the weight multiply, ``silu`` rounded
before the product. The row count ``T`` is never a kernel argument (only the grid's size),
and row strides are runtime arguments, so a new batch size reuses the compiled kernel;
only the row width (``H`` / ``I``) and block sizes are ``tl.constexpr``. Imported only
when ``select_fused_ops`` chooses Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rms_norm", "add_rms_norm", "silu_and_mul"]

_SILU_BLOCK = 1024


@triton.jit
def _norm_row(s, w_ptr, cols, ok, eps, H: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """``s`` [BLOCK] fp32 (0 past ``H``) -> ``w * (s * rsqrt(mean(s^2) + eps))`` in OUT_DTYPE."""
    rstd = tl.rsqrt(tl.sum(s * s, 0) / H + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    normed = (s * rstd).to(OUT_DTYPE).to(tl.float32)
    return (normed * w).to(OUT_DTYPE)


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, x_stride, out_stride, eps,
    H: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    x = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
    out = _norm_row(x, w_ptr, cols, ok, eps, H, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_stride + cols, out, mask=ok)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, res_ptr,
    x_stride, r_stride, out_stride, res_stride, eps,
    H: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    x = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * r_stride + cols, mask=ok, other=0.0).to(tl.float32)
    s = (x + r).to(res_ptr.dtype.element_ty)  # the residual stream is kept in the input dtype
    tl.store(res_ptr + row * res_stride + cols, s, mask=ok)
    out = _norm_row(s.to(tl.float32), w_ptr, cols, ok, eps, H, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_stride + cols, out, mask=ok)


@triton.jit
def _silu_and_mul_kernel(
    in_ptr, out_ptr, in_stride, out_stride,
    I: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    gate = tl.load(in_ptr + row * in_stride + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(in_ptr + row * in_stride + I + cols, mask=ok, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (act * up).to(out_ptr.dtype.element_ty), mask=ok)


def _row_major(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _norm_launch(width: int) -> tuple[int, int]:
    block = triton.next_power_of_2(width)
    return block, 4 if block <= 2048 else 8 if block <= 8192 else 16


def _check_rows(name: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"{name}: expected x [T, H] and weight [H], got {list(x.shape)} "
                         f"and {list(weight.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row; see ``fused_ops.rms_norm`` for the numerics.

    One program per row. Called by the model's first input norm and its final norm.

    Args:
        x: ``[T, H]`` float32/bfloat16/float16 on CUDA (or CPU under the interpreter); any
            row stride. ``T`` may be 0.
        weight: ``[H]``, same dtype and device.
        eps: added to the mean square.

    Returns:
        A new contiguous ``[T, H]`` tensor in ``x.dtype``. Mutates nothing.

    Raises:
        ValueError: ``x`` is not 2-D or ``weight`` is not ``[H]``.
    """
    _check_rows("rms_norm", x, weight)
    x = _row_major(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    block, warps = _norm_launch(x.shape[1])
    _rms_norm_kernel[(x.shape[0],)](
        x, weight, out, x.stride(0), out.stride(0), eps,
        H=x.shape[1], BLOCK=block, num_warps=warps,
    )  # fmt: skip
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``new_residual = x + residual``, then its RMSNorm, in one pass over each row; see
    ``fused_ops.add_rms_norm``.

    One program per row. Called by each decoder layer (before attention and before the MLP)
    and by the final norm.

    Args:
        x: ``[T, H]`` float32/bfloat16/float16 on CUDA (or CPU under the interpreter).
        residual: ``[T, H]``, same dtype and device.
        weight: ``[H]``, same dtype and device.
        eps: added to the mean square.

    Returns:
        ``(normed, new_residual)``, new contiguous ``[T, H]`` tensors in ``x.dtype``.
        Mutates nothing.

    Raises:
        ValueError: the shapes disagree.
    """
    _check_rows("add_rms_norm", x, weight)
    if residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: residual {list(residual.shape)} differs from x "
                         f"{list(x.shape)}")
    x, residual = _row_major(x), _row_major(residual)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(out)
    if x.shape[0] == 0:
        return out, new_residual
    block, warps = _norm_launch(x.shape[1])
    _add_rms_norm_kernel[(x.shape[0],)](
        x, residual, weight, out, new_residual,
        x.stride(0), residual.stride(0), out.stride(0), new_residual.stride(0), eps,
        H=x.shape[1], BLOCK=block, num_warps=warps,
    )  # fmt: skip
    return out, new_residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up = [gate | up]``; see ``fused_ops.silu_and_mul``.

    One program per (row, tile of up to 1024 columns). Called by the gated MLP.

    Args:
        gate_up: ``[T, 2I]`` float32/bfloat16/float16 on CUDA (or CPU under the
            interpreter); any row stride. ``T`` may be 0.

    Returns:
        A new contiguous ``[T, I]`` tensor in ``gate_up.dtype``. Mutates nothing.

    Raises:
        ValueError: ``gate_up`` is not 2-D with an even number of columns.
    """
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_and_mul: expected gate_up [T, 2I], got {list(gate_up.shape)}")
    gate_up = _row_major(gate_up)
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    if tokens == 0:
        return out
    block = min(_SILU_BLOCK, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(tokens, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), I=inter, BLOCK=block,
    )  # fmt: skip
    return out
