"""The decoder's row kernels are batch-invariant as they are: RMSNorm, residual add +
RMSNorm, SiLU-and-mul (``fused_triton``) and the q/k norm + RoPE + KV write
(``rope_kv_triton``) each give a row bitwise the same alone, in a batch of any size and at
any place in it (under the interpreter; natively on CUDA). One program per row (or per
row and head / column tile), blocks sized by the row width only: nothing to fix."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.triton

SIZES = [1, 2, 5, 17]


def _fused() -> Any:
    from deepinfer_kit.models import fused_triton

    return fused_triton


def _rows_alike(op: Callable[[torch.Tensor], tuple[torch.Tensor, ...]], rows: torch.Tensor) -> None:
    """``op`` over every batch of ``SIZES`` rows taken from ``rows`` (shuffled, so a row
    sits at other places beside other rows): each output row equals the row's output alone."""
    alone = [op(rows[i : i + 1]) for i in range(rows.shape[0])]
    gen = torch.Generator().manual_seed(0)
    for size in SIZES:
        pick = torch.randperm(rows.shape[0], generator=gen)[:size]
        outs = op(rows[pick.to(rows.device)])
        for place, i in enumerate(pick.tolist()):
            for got, want in zip(outs, alone[i], strict=True):
                assert torch.equal(got[place : place + 1], want), (size, place)


def _check_fused(dtype: torch.dtype, device: str) -> None:
    gen = torch.Generator().manual_seed(1)
    hidden = 1000
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype).to(device)
    rows = (torch.randn(20, 3 * hidden, generator=gen) * 3).to(dtype).to(device)
    ops = _fused()
    _rows_alike(lambda r: (ops.rms_norm(r[:, :hidden], weight, 1e-6),), rows)
    _rows_alike(lambda r: ops.add_rms_norm(r[:, :hidden], r[:, hidden : 2 * hidden], weight, 1e-5), rows)
    _rows_alike(lambda r: (ops.silu_and_mul(r[:, hidden:]),), rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_row_kernels_are_row_invariant(dtype: torch.dtype) -> None:
    _check_fused(dtype, "cpu")


def _check_rope(dtype: torch.dtype, device: str) -> None:
    """Each token's rotated query and the K/V it writes at its slot: the same bits alone
    and in any batch."""
    from deepinfer_kit.models import rope_kv_triton

    gen = torch.Generator().manual_seed(2)
    hq, hkv, d, rot, tokens = 4, 2, 64, 32, 20
    qkv = (torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen) * 2).to(dtype).to(device)
    weight = (torch.rand(hq + hkv, d, generator=gen) + 0.5).to(dtype).to(device)
    angles = torch.rand(tokens, 1, rot // 2, generator=gen) * 50
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype).to(device)
    sin = torch.cat((-angles.sin(), angles.sin()), -1).to(dtype).to(device)
    slots = torch.randperm(tokens * 2, generator=gen)[:tokens].to(device)
    table = torch.cat([qkv.float(), cos.flatten(1).float(), sin.flatten(1).float(),
                       slots[:, None].float()], dim=1)

    def op(rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = rows.shape[0]
        cache = torch.zeros(2, tokens * 2 // 4, 4, hkv, d, dtype=dtype, device=device)
        width = qkv.shape[1]
        slot = rows[:, -1].long()
        q = rope_kv_triton.rope_kv_write(
            rows[:, :width].to(dtype), weight, 1e-6, rows[:, width : width + rot].to(dtype).view(n, 1, rot),
            rows[:, width + rot : width + 2 * rot].to(dtype).view(n, 1, rot), cache[0], cache[1], slot, hq)
        flat = cache.view(2, -1, hkv, d)
        return q, flat[0][slot], flat[1][slot]

    _rows_alike(op, table)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_kv_write_is_row_invariant(dtype: torch.dtype) -> None:
    _check_rope(dtype, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_kernels_are_row_invariant_on_cuda(dtype: torch.dtype) -> None:
    _check_fused(dtype, "cuda")
    _check_rope(dtype, "cuda")
