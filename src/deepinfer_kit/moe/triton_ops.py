# mypy: disable-error-code="untyped-decorator, no-untyped-def"
"""Triton grouped-GEMM SwiGLU experts driven by a device-side :class:`BlockSchedule`.

Imported only when ``impl="triton"`` is chosen. One kernel, a grouped ``y = x W_e^T`` over
the schedule's ``B``-row tiles, runs twice: first gathering token rows and applying the
SwiGLU epilogue over the fused ``[2I, H]`` gate/up weights, then over those activations
with the ``[H, I]`` down weights, scaling by the combine weights and storing each row at
its flat routing position. The grid is ``(G, cdiv(n_out, BLOCK_N))`` with ``G`` fixed by
the shapes (:func:`~deepinfer_kit.moe.align.schedule_size`); a tile whose expert is ``-1``
returns at once and rows that are padding are masked, so nothing on this path reads the
device from the host (:func:`routed_swiglu` can be captured in a CUDA graph).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.moe.align import BlockSchedule, align_block_size
from deepinfer_kit.moe.expert_variants import ExpertActivation

__all__ = ["choose_block_m", "grouped_swiglu", "routed_swiglu", "INVARIANT_BLOCK_M"]

_BLOCK_N = 32
_BLOCK_K = 32

INVARIANT_BLOCK_M = 16
"""Rows per tile of the batch-invariant mode (``invariant=True``), whatever the copy
counts: :func:`choose_block_m` picks the tile from the batch, and a GPU may run a tile
of other rows with another instruction shape, which sums a row differently."""


@triton.jit
def _dot(x, w, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + x @ w``; fp32 operands in IEEE precision (no TF32) when ``IEEE``."""
    if UPCAST:
        x = x.to(tl.float32)
        w = w.to(tl.float32)
    if IEEE:
        return tl.dot(x, w, acc, input_precision="ieee")
    return tl.dot(x, w, acc)


@triton.jit(do_not_specialize=["num_copies"])  # T * k: any value, one variant
def _scheduled_linear_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    scale_ptr,
    row_source_ptr,
    tile_expert_ptr,
    num_copies,
    K,
    N,
    stride_xm,
    stride_we,
    stride_wn,
    stride_om,
    bias_ptr,
    stride_be,
    alpha,
    limit,
    GATHER_DIV: tl.constexpr,
    SCATTER: tl.constexpr,
    SWIGLU: tl.constexpr,
    SCALE: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BIAS: tl.constexpr = False,
    CLAMPED: tl.constexpr = False,
):
    """One ``BLOCK_M x BLOCK_N`` tile of ``out = x W_e^T`` for the tile's expert ``e``.

    Input row of padded row ``r``: ``row_source[r] // GATHER_DIV`` when ``GATHER_DIV > 0``
    (token rows of the hidden states), else ``r`` (padded activations). Output row:
    ``row_source[r]`` when ``SCATTER``, else ``r``. Rows with ``row_source >= num_copies``
    are padding: neither loaded nor stored. ``BIAS``: add row ``e`` of ``bias``
    (``[S, N]``, or ``[S, 2N]`` gate then up with ``SWIGLU``) before the epilogue and the
    scale. ``CLAMPED``: gpt-oss's clamped SwiGLU (``alpha``, ``limit``) in place of SwiGLU.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + pid_m)
    if expert < 0:
        return
    padded = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    source = tl.load(row_source_ptr + padded)
    row_ok = source < num_copies
    if GATHER_DIV > 0:
        in_rows = source // GATHER_DIV
    else:
        in_rows = padded.to(tl.int64)
    if SCATTER:
        out_rows = source
    else:
        out_rows = padded.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(
            x_ptr + in_rows[:, None] * stride_xm + ks[None, :],
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
    if BIAS:
        b_base = bias_ptr + expert.to(tl.int64) * stride_be
        acc += tl.load(b_base + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if SWIGLU:
            acc_up += tl.load(b_base + cols + N, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if SWIGLU and CLAMPED:
        gate = tl.minimum(acc, limit)
        up = tl.minimum(tl.maximum(acc_up, -limit), limit)
        acc = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    elif SWIGLU:
        acc = acc * tl.sigmoid(acc) * acc_up
    if SCALE:
        acc = acc * tl.load(scale_ptr + source, mask=row_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + out_rows[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def choose_block_m(num_copies: int, num_experts: int) -> int:
    """Rows per tile: 16 when experts average at most 16 copies (decode), else 32.

    A function of sizes only, so the choice is fixed for a captured shape.
    """
    return 16 if num_copies <= 16 * num_experts else 32


def _scheduled_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    schedule: BlockSchedule,
    *,
    gather_div: int,
    scatter: bool,
    swiglu: bool,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    clamp: ExpertActivation | None = None,
) -> None:
    n_out = out.shape[1]
    tiles = schedule.tile_expert.shape[0]
    if tiles == 0 or n_out == 0:
        return
    grid = (tiles, triton.cdiv(n_out, _BLOCK_N))
    _scheduled_linear_kernel[grid](
        x,
        w,
        out,
        scale if scale is not None else out,
        schedule.row_source,
        schedule.tile_expert,
        schedule.num_copies,
        x.shape[1],
        n_out,
        x.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        bias if bias is not None else out,  # unread without BIAS
        bias.stride(0) if bias is not None else 0,
        clamp.alpha if clamp is not None else 1.0,
        clamp.limit if clamp is not None else 0.0,
        GATHER_DIV=gather_div,
        SCATTER=scatter,
        SWIGLU=swiglu,
        SCALE=scale is not None,
        IEEE=x.dtype == torch.float32,
        # The interpreter's tl.dot on 16-bit floats returns garbage (triton 3.9): upcast there.
        UPCAST=x.dtype != torch.float32 and os.environ.get("TRITON_INTERPRET") == "1",
        BLOCK_M=schedule.block_m,
        BLOCK_N=_BLOCK_N,
        BLOCK_K=_BLOCK_K,
        BIAS=bias is not None,
        CLAMPED=clamp is not None,
    )


def _swiglu_on_schedule(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    schedule: BlockSchedule,
    gather_div: int,
    out: torch.Tensor,
    scale: torch.Tensor | None,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: ExpertActivation | None = None,
) -> None:
    """Both GEMMs: ``x`` rows gathered per ``row_source``, outputs stored at ``row_source``
    (the biases, ``[S, 2I]`` and ``[S, H]``, and a clamped ``activation`` when given)."""
    inter = down.shape[2]
    act = torch.empty(schedule.row_source.shape[0], inter, dtype=x.dtype, device=x.device)
    clamp = activation if activation is not None and activation.clamped else None
    _scheduled_linear(x, gate_up, act, schedule, gather_div=gather_div, scatter=False, swiglu=True, scale=None,
                      bias=_rows(gate_up_bias), clamp=clamp)
    _scheduled_linear(act, down, out, schedule, gather_div=0, scatter=True, swiglu=False, scale=scale,
                      bias=_rows(down_bias))


def _rows(bias: torch.Tensor | None) -> torch.Tensor | None:
    """``bias`` with unit stride along its last dim (what the kernel indexes), or None."""
    return None if bias is None else bias.contiguous()


def routed_swiglu(
    hidden: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    invariant: bool = False,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: ExpertActivation | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed SwiGLU experts and their weighted combine, with no host synchronisation.

    ``y[t] = sum_j weights[t, j] * E_{expert_ids[t, j]}(hidden[t])``: the block schedule
    (:func:`~deepinfer_kit.moe.align.align_block_size`), the gate/up GEMM with the SwiGLU
    epilogue reading token rows in place, the down GEMM scaling each copy by its weight
    (fp32) into a ``[T * k, H]`` fp32 buffer at the copy's flat position (each written
    once, no atomics), then a sum over the ``k`` slots in slot order (deterministic).
    Every launch size follows from the shapes, so this can run under CUDA-graph capture.
    Mutates nothing.

    Args:
        hidden: ``[T, H]`` (cast to the weight dtype).
        expert_ids: ``[T, k]`` int64 ids in ``[0, E)`` (not range-checked).
        weights: ``[T, k]`` combine weights.
        gate_up: ``[E, 2I, H]``.
        down: ``[E, H, I]``.
        invariant: batch-invariant mode: tiles of :data:`INVARIANT_BLOCK_M` rows whatever
            the copy counts, and the ``k`` slots of a token added one after the other in
            slot order (``((y_0 + y_1) + y_2) + ...``, elementwise) rather than by a
            reduction kernel whose grouping may follow the batch's size; so a token's
            output does not depend on the other tokens of the call. Default: the tile
            by :func:`choose_block_m` and a ``sum`` over the slots.
        gate_up_bias, down_bias: ``[E, 2I]`` and ``[E, H]`` projection biases, added in
            fp32 before the activation and before the combine weight scales a copy
            (``expert_variants`` is their torch reference); ``None``: no bias.
        activation: a clamped SwiGLU (gpt-oss) in place of SwiGLU; ``None`` or a plain
            ``"swiglu"``: SwiGLU.

    Returns:
        ``(y [T, H] in the weight dtype, counts [E] int64)``, both on the device of
        ``hidden``; ``counts`` are copies routed to each expert.
    """
    x = hidden.to(gate_up.dtype).contiguous()
    gate_up = gate_up.contiguous()
    down = down.contiguous()
    num_tokens, top_k = expert_ids.shape
    num_experts, hidden_size = gate_up.shape[0], down.shape[1]
    block_m = INVARIANT_BLOCK_M if invariant else choose_block_m(num_tokens * top_k, num_experts)
    schedule = align_block_size(expert_ids, num_experts, block_m)
    rows = torch.empty(num_tokens * top_k, hidden_size, dtype=torch.float32, device=x.device)
    scale = weights.reshape(-1).float().contiguous()
    _swiglu_on_schedule(x, gate_up, down, schedule, top_k, rows, scale, gate_up_bias, down_bias, activation)
    slots = rows.view(num_tokens, top_k, hidden_size)
    if invariant:
        total = slots[:, 0].clone()
        for slot in range(1, top_k):
            total += slots[:, slot]
    else:
        total = slots.sum(dim=1)
    return total.to(x.dtype), schedule.expert_counts


def grouped_swiglu(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    counts: Sequence[int],
    *,
    invariant: bool = False,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: ExpertActivation | None = None,
) -> torch.Tensor:
    """SwiGLU experts over expert-contiguous rows: ``ref_ops.grouped_swiglu`` on Triton
    (with biases and a clamped activation: ``expert_variants.grouped_experts``, as in
    :func:`routed_swiglu`).

    Same arguments and result (``x [M, H]``, ``gate_up [E, 2I, H]``, ``down [E, H, I]``,
    ``counts``: ``E`` host ints -> ``[M, H]`` in the dtype of ``x``); fp32 accumulation.
    The rows' expert ids are expanded from ``counts`` (one host-to-device copy) and run
    through the same block schedule and kernels as :func:`routed_swiglu` with ``k = 1``.
    With ``invariant`` (batch-invariant mode) the tiles are :data:`INVARIANT_BLOCK_M`
    rows whatever the counts, so a row's output does not depend on how many rows share
    its expert; default: :func:`choose_block_m`. Mutates nothing.

    Raises:
        ConfigError: ``counts`` does not have ``E`` entries summing to ``M``.
    """
    num_experts, rows = gate_up.shape[0], x.shape[0]
    if len(counts) != num_experts or sum(counts) != rows:
        raise ConfigError(f"counts must be {num_experts} ints summing to {rows}, got {list(counts)}")
    x = x.contiguous()
    gate_up = gate_up.contiguous()
    down = down.contiguous()
    ids = torch.repeat_interleave(
        torch.arange(num_experts, device=x.device),
        torch.tensor(list(counts), dtype=torch.int64, device=x.device),
        output_size=rows,
    )
    block_m = INVARIANT_BLOCK_M if invariant else choose_block_m(rows, num_experts)
    schedule = align_block_size(ids.view(rows, 1), num_experts, block_m)
    out = torch.empty(rows, down.shape[1], dtype=x.dtype, device=x.device)
    _swiglu_on_schedule(x, gate_up, down, schedule, 1, out, None, gate_up_bias, down_bias, activation)
    return out
