"""Triton kernels against the torch reference ops (under the interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
from kernel_compile import assert_kernels_compile

from deepinfer_kit.sample import ref_ops
from deepinfer_kit.sample.candidates import sorted_candidates

pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def triton_ops():  # type: ignore[no-untyped-def]
    from deepinfer_kit.sample import triton_ops as module

    return module


def _case(seed: int, rows: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen) * (1 + 3 * torch.rand(rows, 1, generator=gen))
    x[torch.rand(rows, vocab, generator=gen) < 0.3] = float("-inf")
    x[1] = float("-inf")  # nothing finite
    x[2, :] = float("-inf")
    x[2, vocab - 1] = 4.0  # only the very last token
    x[3] = 1.0  # all tied
    pick = torch.randperm(rows, generator=gen)[: rows - 2]
    return x, torch.cat([torch.tensor([1, 2, 3]), pick]), gen


@pytest.mark.parametrize("vocab", [7, 1024, 2500])
def test_row_norm_and_full_draw_match(triton_ops, vocab: int) -> None:  # type: ignore[no-untyped-def]
    x, rows, gen = _case(vocab, 12, vocab)
    n = rows.shape[0]
    inv_t = (0.3 + 2 * torch.rand(n, generator=gen)).float()
    min_p = torch.where(torch.rand(n, generator=gen) < 0.5, 0.0, 0.2 * torch.rand(n, generator=gen))
    u = torch.rand(n, dtype=torch.float64, generator=gen)
    u[0], u[-1] = 0.0, 1.0 - 2.0**-53
    ref_z, tri_z = ref_ops.row_norm(x, rows, inv_t), triton_ops.row_norm(x, rows, inv_t)
    assert torch.allclose(ref_z, tri_z, rtol=1e-5)
    ref_t = ref_ops.full_draw(x, rows, inv_t, min_p, u)
    tri_t = triton_ops.full_draw(x, rows, inv_t, min_p, u)
    assert torch.equal(ref_t, tri_t)
    assert bool(torch.isfinite(x[rows, tri_t])[torch.tensor([r != 1 for r in rows.tolist()])].all())


@pytest.mark.parametrize("width", [1, 33, 1500])
def test_candidate_draw_matches(triton_ops, width: int) -> None:  # type: ignore[no-untyped-def]
    vocab = max(width, 40)
    x, rows, gen = _case(width, 16, vocab)
    vals, idx = sorted_candidates(x, rows)
    vals, idx = vals[:, :width].contiguous(), idx[:, :width].contiguous()
    n = rows.shape[0]
    inv_t = (0.3 + 2 * torch.rand(n, generator=gen)).float()
    k = torch.randint(1, width + 3, (n,), generator=gen)
    k[::3] = vocab  # top-p only rows
    p = torch.where(torch.rand(n, generator=gen) < 0.3, 1.0, torch.rand(n, generator=gen).double())
    p = p.double().clamp(min=0.05)
    min_p = torch.where(torch.rand(n, generator=gen) < 0.5, 0.0, 0.3 * torch.rand(n, generator=gen))
    z = torch.where(k >= vocab, ref_ops.row_norm(x, rows, inv_t), torch.zeros(n, dtype=torch.float64))
    u = torch.rand(n, dtype=torch.float64, generator=gen)
    ref = ref_ops.candidate_draw(vals, idx, inv_t, k, p, min_p, z, u)
    tri = triton_ops.candidate_draw(vals, idx, inv_t, k, p, min_p, z, u)
    assert torch.equal(ref[1], tri[1])
    assert torch.equal(ref[0], tri[0])
    assert bool((ref[1] >= -1).all()) and bool((ref[1] <= torch.clamp(k, max=width)).all())



_SIGNATURES = {
    "_row_norm_kernel": "x_ptr:*fp32 rows_ptr:*i64 inv_t_ptr:*fp32 out_ptr:*fp64 stride:i32 V:i32",
    "_full_draw_kernel": "x_ptr:*fp32 rows_ptr:*i64 inv_t_ptr:*fp32 min_p_ptr:*fp32 "
    "u_ptr:*fp64 out_ptr:*i64 stride:i32 V:i32",
    "_candidate_kernel": "vals_ptr:*fp32 idx_ptr:*i64 inv_t_ptr:*fp32 k_ptr:*i64 p_ptr:*fp64 "
    "min_p_ptr:*fp32 z_ptr:*fp64 u_ptr:*fp64 tok_ptr:*i64 kept_ptr:*i64 W:i32",
    "nucleus_kernel": "x_ptr:*fp32 rows_ptr:*i64 inv_t_ptr:*fp32 p_ptr:*fp64 min_p_ptr:*fp32 "
    "u_ptr:*fp64 tok_ptr:*i64 kept_ptr:*i64 out_ptr:*i64 stride:i32 V:i32",
}
_CONSTANTS = {
    "_row_norm_kernel": {"BLOCK": 1024},
    "_full_draw_kernel": {"BLOCK": 1024},
    "_candidate_kernel": {"BLOCK": 64},
    "nucleus_kernel": {"BLOCK": 256, "SPLITS": 16, "Z_BLOCK": 1024},
}


def test_kernels_compile_for_a_cuda_target() -> None:
    """Every sampling kernel compiles for sm_90 (see tests/kernel_compile.py)."""
    assert_kernels_compile("deepinfer_kit.sample.triton_ops", _SIGNATURES, _CONSTANTS,
                           ("W", "V", "stride"), env_extra={"TRITON_DEFAULT_FP_FUSION": "1"})
