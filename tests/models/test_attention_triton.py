"""Triton paged attention against the torch reference (interpreter on CPU, native on CUDA)."""

from __future__ import annotations

import random

import pytest
import torch
from paged_cases import HEAD_LAYOUTS, dense_attention, make_case, random_lengths

from deepinfer_kit.models.attention import PagedAttention, ref_ops

pytestmark = pytest.mark.triton


def _triton(case, num_splits=None) -> torch.Tensor:
    from deepinfer_kit.models.attention import triton_ops

    return triton_ops.paged_attention(
        case.query, case.key_cache, case.value_cache, case.meta, case.scale, None, num_splits
    )


def _ref(case) -> torch.Tensor:
    return ref_ops.paged_attention(case.query, case.key_cache, case.value_cache, case.meta, case.scale)


@pytest.mark.parametrize("seed", range(6))
def test_random_layouts_match_reference(seed: int) -> None:
    rng = random.Random(100 + seed)
    hq, hkv = rng.choice(HEAD_LAYOUTS)
    lengths = random_lengths(rng, rng.randint(1, 4), max_ctx=48)
    case = make_case(
        lengths, block_size=rng.choice([16, 32]), num_heads=hq, num_kv_heads=hkv, seed=seed
    )
    torch.testing.assert_close(_triton(case), _ref(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "lengths",
    [
        pytest.param([(1, 1), (1, 70), (1, 33)], id="decode"),
        pytest.param([(3, 40), (8, 8), (2, 65)], id="multi-token-decode"),
        pytest.param([(20, 20), (18, 50)], id="prefill-and-chunked"),
        pytest.param([(1, 64), (24, 24), (4, 20), (19, 50)], id="mixed"),
    ],
)
@pytest.mark.parametrize("block_size", [16, 32])
def test_named_layouts_match_reference(lengths: list[tuple[int, int]], block_size: int) -> None:
    case = make_case(lengths, block_size=block_size, num_heads=6, num_kv_heads=2, seed=1)
    torch.testing.assert_close(_triton(case), _ref(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [2, 3])
@pytest.mark.parametrize("lengths", [[(1, 90), (1, 5), (1, 40)], [(4, 70), (2, 2), (1, 33)]])
def test_split_context_matches_reference(lengths: list[tuple[int, int]], num_splits: int) -> None:
    case = make_case(lengths, block_size=16, num_heads=3, num_kv_heads=1, seed=num_splits)
    torch.testing.assert_close(_triton(case, num_splits), _ref(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [24, 8])
def test_head_dim_not_a_power_of_two_or_below_16(head_dim: int) -> None:
    case = make_case(
        [(1, 37), (12, 12), (3, 50)], block_size=32, num_heads=6, num_kv_heads=3,
        head_dim=head_dim, seed=head_dim,
    )  # fmt: skip
    torch.testing.assert_close(_triton(case), _ref(case), atol=1e-5, rtol=1e-5)


def test_backend_selects_triton_under_interpreter() -> None:
    case = make_case([(1, 20), (5, 5)], block_size=16, num_heads=4, num_kv_heads=2)
    attn = PagedAttention(4, 2, 16, case.scale, impl="triton")
    assert attn.impl == "triton"
    out = attn(case.query, case.key_cache, case.value_cache, case.meta)
    torch.testing.assert_close(out.double(), dense_attention(case), atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("seed", range(4))
def test_bf16_on_cuda_matches_reference(seed: int) -> None:
    rng = random.Random(seed)
    hq, hkv = rng.choice(HEAD_LAYOUTS)
    lengths = random_lengths(rng, 8, max_ctx=300)
    case = make_case(
        lengths, block_size=rng.choice([16, 32]), num_heads=hq, num_kv_heads=hkv,
        head_dim=64, dtype=torch.bfloat16, device="cuda", seed=seed,
    )  # fmt: skip
    torch.testing.assert_close(_triton(case).float(), _ref(case).float(), atol=2e-2, rtol=2e-2)


def test_split_choice_only_for_decode_batches_with_long_context() -> None:
    from deepinfer_kit.models.attention.triton_ops import choose_num_splits

    def meta(qlens, slens):
        case = make_case(list(zip(qlens, slens)), block_size=32, num_heads=2, num_kv_heads=2)
        return case.meta

    long_decode = meta([1, 1], [1024, 700])
    assert choose_num_splits(long_decode, 2, target_programs=264) == 1024 // 256
    assert choose_num_splits(long_decode, 2, target_programs=1) == 1
    assert choose_num_splits(meta([1, 1], [100, 50]), 2, target_programs=264) == 1
    assert choose_num_splits(meta([9, 1], [1024, 700]), 2, target_programs=264) == 1
