"""The batch-invariant Triton GEMM (``models.invariant_triton.linear``): against its torch
reference ``invariant.invariant_linear`` (the interpreter on CPU), a row bitwise the same
in any batch (the interpreter with a row-alone dot, see ``tests/row_dot.py``; natively on
CUDA), one launch configuration for every row count, and a compile for sm_90."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kernel_compile import assert_kernels_compile
from row_dot import row_invariant_dot  # noqa: F401 (fixture)

from deepinfer_kit.models.invariant import invariant_linear

pytestmark = pytest.mark.triton

BATCHES = [1, 2, 5, 17, 64]


def _linear() -> Any:
    from deepinfer_kit.models import invariant_triton

    return invariant_triton


def _weights(k: int, n: int, dtype: torch.dtype, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k**0.5
    return w.to(dtype).to(device), torch.randn(n, generator=gen).to(dtype).to(device)


@pytest.mark.parametrize("tokens", [0, 1, 3, 8, 37])
@pytest.mark.parametrize(("k", "n"), [(100, 70), (33, 129)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_the_torch_reference(tokens: int, k: int, n: int, with_bias: bool) -> None:
    w, b = _weights(k, n, torch.float32, "cpu", seed=k + n)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(tokens)) * 3
    bias = b if with_bias else None
    got = _linear().linear(x, w, bias)
    assert got.shape == (tokens, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, invariant_linear(x, w, bias), rtol=1e-5, atol=1e-5)


def test_strided_input_and_bf16_within_tolerance() -> None:
    w, b = _weights(80, 50, torch.bfloat16, "cpu", seed=3)
    x = torch.randn(9, 90, generator=torch.Generator().manual_seed(4)).bfloat16()[:, 5:85]
    got = _linear().linear(x, w, b)
    assert got.dtype == torch.bfloat16 and got.is_contiguous()
    expected = invariant_linear(x.float(), w.float(), b.float())
    # The interpreter rounds to bf16 by truncation, one ulp (2^-8 relative) off torch.
    torch.testing.assert_close(got.float(), expected, rtol=3e-2, atol=3e-2)


def test_mismatched_shapes_are_refused() -> None:
    w, b = _weights(16, 8, torch.float32, "cpu", seed=0)
    with pytest.raises(ValueError, match="invariant linear"):
        _linear().linear(torch.zeros(2, 15), w, b)
    with pytest.raises(ValueError, match="bias"):
        _linear().linear(torch.zeros(2, 16), w, b[:7])


def _same_row_in_batches(k: int, n: int, dtype: torch.dtype, device: str, with_bias: bool) -> None:
    """Row ``v`` alone, and at the first, a middle and the last place of batches of
    ``BATCHES`` rows of random others, contiguous or a view one element off alignment (a
    compiled kernel specializes on pointer alignment): bitwise the same output row."""
    w, b = _weights(k, n, dtype, device, seed=7)
    bias = b if with_bias else None
    gen = torch.Generator().manual_seed(11)
    v = (torch.randn(1, k, generator=gen) * 2).to(dtype).to(device)
    alone = _linear().linear(v, w, bias)
    for rows in BATCHES:
        for place in sorted({0, rows // 2, rows - 1}):
            wide = (torch.randn(rows, k + 1, generator=gen) * 2).to(dtype).to(device)
            wide[place, 1:] = v[0]
            for batch in (wide[:, 1:], wide[:, 1:].contiguous()):
                got = _linear().linear(batch, w, bias)[place : place + 1]
                assert torch.equal(got, alone), f"row at {place} of {rows} differs from the row alone"


@pytest.mark.usefixtures("row_invariant_dot")
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_row_is_bitwise_the_same_in_any_batch(with_bias: bool) -> None:
    _same_row_in_batches(100, 70, torch.float32, "cpu", with_bias)


class _Capture:
    """Stands in for the kernel: keeps each launch's grid and arguments, runs nothing."""

    def __init__(self) -> None:
        self.launches: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches.append((grid, args, kwargs))

        return launch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_launch_configuration_for_every_row_count(monkeypatch: pytest.MonkeyPatch,
                                                       dtype: torch.dtype) -> None:
    """Tiles, warps and every argument but the row count and the pointers are the same
    whatever ``T``: the kernel a row runs never depends on its batch."""
    module = _linear()
    capture = _Capture()
    monkeypatch.setattr(module, "_linear_kernel", capture)
    w, b = _weights(96, 200, dtype, "cpu", seed=1)
    for rows in (1, 2, 7, 8, 64, 65, 1000):
        module.linear(torch.zeros(rows, 96, dtype=dtype), w, b)
    configs = set()
    for grid, args, kwargs in capture.launches:
        scalars = tuple(a for i, a in enumerate(args) if not isinstance(a, torch.Tensor) and i != 4)
        configs.add((grid[0], scalars, tuple(sorted(kwargs.items()))))
    assert len(configs) == 1, configs


@pytest.mark.parametrize(("dtype", "name"), [
    (torch.bfloat16, "bf16"), pytest.param(torch.float32, "fp32", marks=pytest.mark.slow)])
def test_kernel_compiles_for_a_cuda_target(dtype: torch.dtype, name: str) -> None:
    """The GEMM compiles for sm_90 (see tests/kernel_compile.py)."""
    sig = ("x_ptr:*{t} w_ptr:*{t} b_ptr:*{t} out_ptr:*{t} M:i32 N:i32 K:i32 stride_xm:i32 "
           "stride_xk:i32 stride_wn:i32 stride_wk:i32 stride_om:i32")
    bm, bn, bk, _ = _linear().tile_config(dtype)
    constants = {"HAS_BIAS": 1, "IEEE": int(dtype == torch.float32), "UPCAST": 0,
                 "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
    assert_kernels_compile("deepinfer_kit.models.invariant_triton", {"_linear_kernel": sig.format(t=name)},
                           {"_linear_kernel": constants}, ("N", "K", "stride_xk"))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_row_is_bitwise_the_same_in_any_batch_on_cuda(dtype: torch.dtype, with_bias: bool) -> None:
    _same_row_in_batches(1000, 300, dtype, "cuda", with_bias)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_torch_reference_on_cuda(dtype: torch.dtype) -> None:
    w, b = _weights(1000, 300, dtype, "cuda", seed=5)
    for tokens in (1, 3, 8, 37, 300):
        x = torch.randn(tokens, 1000, generator=torch.Generator().manual_seed(tokens)).to(dtype).cuda()
        expected = invariant_linear(x.float(), w.float(), b.float())
        tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        torch.testing.assert_close(_linear().linear(x, w, b).float(), expected, **tol)
