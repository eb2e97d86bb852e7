"""The Triton grouped SwiGLU kernel equals the torch reference (under the interpreter on CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer_kit.moe.ref_ops import grouped_swiglu

pytestmark = pytest.mark.triton


def _case(seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    experts, hidden, inter = rng.randint(1, 6), rng.choice([16, 40, 64]), rng.choice([8, 24, 32])
    counts = [rng.choice([0, 1, rng.randint(2, 70)]) for _ in range(experts)]
    x = torch.randn(sum(counts), hidden, generator=gen).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    return x, gate_up, down, counts


@pytest.mark.parametrize("seed", range(6))
def test_triton_grouped_swiglu_equals_reference_fp32(seed: int) -> None:
    from deepinfer_kit.moe.triton_ops import grouped_swiglu as triton_grouped_swiglu

    x, gate_up, down, counts = _case(seed, torch.float32)
    expected = grouped_swiglu(x, gate_up, down, counts)
    torch.testing.assert_close(triton_grouped_swiglu(x, gate_up, down, counts), expected, rtol=1e-4, atol=1e-5)


def test_triton_grouped_swiglu_bf16_within_stated_tolerance() -> None:
    from deepinfer_kit.moe.triton_ops import grouped_swiglu as triton_grouped_swiglu

    x, gate_up, down, counts = _case(11, torch.bfloat16)
    expected = grouped_swiglu(x.float(), gate_up.float(), down.float(), counts)
    got = triton_grouped_swiglu(x, gate_up, down, counts)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


def test_empty_batch() -> None:
    from deepinfer_kit.moe.triton_ops import grouped_swiglu as triton_grouped_swiglu

    x, gate_up, down, _ = _case(0, torch.float32)
    out = triton_grouped_swiglu(x[:0], gate_up, down, [0] * gate_up.shape[0])
    assert out.shape == (0, x.shape[1])


def test_counts_must_cover_the_rows() -> None:
    from deepinfer_kit.errors import ConfigError
    from deepinfer_kit.moe.triton_ops import grouped_swiglu as triton_grouped_swiglu

    x, gate_up, down, counts = _case(1, torch.float32)
    with pytest.raises(ConfigError, match=r"counts must be \d+ ints summing to"):
        triton_grouped_swiglu(x, gate_up, down, [*counts[:-1], counts[-1] + 1])
