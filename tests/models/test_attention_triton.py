"""Triton paged attention against the torch reference (interpreter on CPU, native on CUDA)."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import attrs
import pytest
import torch
from paged_cases import HEAD_LAYOUTS, dense_attention, make_case, random_lengths

from deepinfer_kit.models.attention import PagedAttention, ref_ops
from deepinfer_kit.models.records import AttentionMetadata

pytestmark = pytest.mark.triton


def _triton(case, num_splits=None, meta=None, window=None) -> torch.Tensor:
    from deepinfer_kit.models.attention import triton_ops

    return triton_ops.paged_attention(
        case.query, case.key_cache, case.value_cache, meta or case.meta, case.scale, window,
        num_splits,
    )


def _ref(case, window=None) -> torch.Tensor:
    return ref_ops.paged_attention(case.query, case.key_cache, case.value_cache, case.meta, case.scale,
                                   window)


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


@pytest.mark.parametrize("num_splits", [1, 2, 3, 5])
def test_context_lengths_come_from_the_device_tensors_only(num_splits: int) -> None:
    """A captured CUDA graph replays with new ``seq_lens``/``block_tables`` in its tensors
    and the host fields of the capture: the result must not depend on ``max_seq_len``
    (stale and too small, or far too large) nor on ``seq_lens_host``."""
    qlens = [1, 1, 3, 1]
    captured = make_case(list(zip(qlens, [4, 30, 10, 2])), block_size=16, num_heads=4,
                         num_kv_heads=2, seed=1)
    replayed = make_case(list(zip(qlens, [150, 7, 96, 65])), block_size=16, num_heads=4,
                         num_kv_heads=2, seed=2)
    expected = _ref(replayed)
    for host in (captured.meta, attrs.evolve(replayed.meta, max_seq_len=1 << 20)):
        stale = attrs.evolve(replayed.meta, max_seq_len=host.max_seq_len,
                             seq_lens_host=list(host.seq_lens_host))
        torch.testing.assert_close(_triton(replayed, num_splits, stale), expected,
                                   atol=1e-5, rtol=1e-5)


def _with_padded_requests(meta: AttentionMetadata, at: list[int], seq_len: int) -> AttentionMetadata:
    """``meta`` with requests of query length 0 (context ``seq_len``, table row 0s) inserted
    before the requests ``at``, as a padded CUDA-graph batch holds them."""
    qlens, slens = list(meta.query_lens_host), list(meta.seq_lens_host)
    tables = meta.block_tables.tolist()
    for r in sorted(at, reverse=True):
        qlens.insert(r, 0)
        slens.insert(r, seq_len)
        tables.insert(r, [0] * meta.block_tables.shape[1])
    starts = [0]
    for q in qlens:
        starts.append(starts[-1] + q)
    dev = meta.seq_lens.device
    return attrs.evolve(
        meta, block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(slens, dtype=torch.int32, device=dev),
        max_seq_len=max(slens), query_lens_host=qlens, seq_lens_host=slens,
    )  # fmt: skip


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("pad_seq_len", [0, 20])
def test_requests_with_no_query_tokens_produce_nothing(num_splits: int, pad_seq_len: int) -> None:
    case = make_case([(1, 40), (5, 21), (1, 9)], block_size=16, num_heads=6, num_kv_heads=2, seed=3)
    padded = _with_padded_requests(case.meta, [0, 2, 3], pad_seq_len)
    expected = dense_attention(case)
    for out in (_triton(case, num_splits, padded), _ref(dataclasses.replace(case, meta=padded))):
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_a_batch_of_padded_requests_only_is_empty() -> None:
    case = make_case([(1, 8)], block_size=16, num_heads=2, num_kv_heads=1, seed=4)
    meta = attrs.evolve(
        _with_padded_requests(case.meta, [0, 0], 0),
        query_start_loc=torch.zeros(4, dtype=torch.int32), slot_mapping=torch.zeros(0, dtype=torch.int64),
        query_lens_host=[0, 0, 0], max_query_len=0,
    )  # fmt: skip
    empty = dataclasses.replace(case, query=case.query[:0], meta=meta)
    assert _triton(empty, 2).shape == _ref(empty).shape == (0, 2, 16)


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


@pytest.mark.cuda
def test_new_batch_shapes_reuse_the_compiled_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Request count, context lengths and table width are runtime values: other decode
    batches (same split count) compile nothing."""
    import triton

    def run(seed: int, num_requests: int, max_ctx: int) -> None:
        rng = random.Random(seed)
        lengths = [(1, rng.randint(1, max_ctx)) for _ in range(num_requests)]
        case = make_case(lengths, block_size=16, num_heads=8, num_kv_heads=2, head_dim=64,
                         dtype=torch.bfloat16, device="cuda", seed=seed)
        for splits in (1, 4):
            torch.testing.assert_close(_triton(case, splits).float(), _ref(case).float(),
                                       atol=2e-2, rtol=2e-2)

    run(0, 4, 100)
    compiled: list[str] = []

    def on_compile(**info: Any) -> None:
        compiled.append(info["repr"])

    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", on_compile)
    for seed, (num_requests, max_ctx) in enumerate([(1, 10), (7, 300), (33, 1000), (2, 17)]):
        run(seed + 1, num_requests, max_ctx)
    assert compiled == []


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


@pytest.mark.parametrize("window", [1, 5, 32, 33, 70])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("lengths", [
    pytest.param([(1, 90), (1, 5), (1, 40)], id="decode"),
    pytest.param([(20, 90), (7, 7), (3, 66)], id="prefill-chunks-and-verify"),
])
def test_sliding_window_matches_reference(lengths: list[tuple[int, int]], num_splits: int, window: int) -> None:
    """Windows shorter than a key tile, a tile and one past it, and longer than some
    contexts; whole tiles before the window are skipped (also across splits)."""
    case = make_case(lengths, block_size=16, num_heads=6, num_kv_heads=2, seed=window)
    want = _ref(case, window)
    torch.testing.assert_close(_triton(case, num_splits, window=window), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(want.double(), dense_attention(case, sliding_window=window), atol=1e-5,
                               rtol=1e-5)


def test_the_backend_runs_sliding_windows_on_triton() -> None:
    attn = PagedAttention(4, 2, 16, 0.25, impl="triton", sliding_window=8)
    assert attn.impl == "triton"


@pytest.mark.cuda
@pytest.mark.parametrize("window", [7, 64, 200])
def test_sliding_window_on_cuda_matches_reference(window: int) -> None:
    rng = random.Random(window)
    lengths = random_lengths(rng, 8, max_ctx=300)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        case = make_case(lengths, block_size=16, num_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype,
                         device="cuda", seed=window)
        for splits in (1, 4):
            torch.testing.assert_close(_triton(case, splits, window=window).float(),
                                       _ref(case, window).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_sinks_match_reference(num_splits: int, window: int | None) -> None:
    """Attention sinks folded in after the keys (one split) or at the merge (several)."""
    case = make_case([(1, 90), (4, 40), (20, 20), (1, 3)], block_size=16, num_heads=6, num_kv_heads=2, seed=8)
    sinks = torch.tensor([-2.0, 0.5, 3.0, 1.0, -0.5, 6.0])
    from deepinfer_kit.models.attention import triton_ops

    got = triton_ops.paged_attention(case.query, case.key_cache, case.value_cache, case.meta, case.scale, window,
                                     num_splits, sinks=sinks)
    want = ref_ops.paged_attention(case.query, case.key_cache, case.value_cache, case.meta, case.scale, window,
                                   sinks=sinks)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(want.double(), dense_attention(case, window, sinks), atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("window", [None, 64])
def test_sinks_on_cuda_match_reference(window: int | None) -> None:
    """The compiled kernel's sink term (after the keys, and at the split merge) in fp32 and bf16."""
    from deepinfer_kit.models.attention import triton_ops

    lengths = random_lengths(random.Random(5), 8, max_ctx=300)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        case = make_case(lengths, block_size=16, num_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype,
                         device="cuda", seed=3)
        sinks = torch.linspace(-3.0, 5.0, 8, device="cuda")
        want = ref_ops.paged_attention(case.query, case.key_cache, case.value_cache, case.meta, case.scale,
                                       window, sinks=sinks).float()
        for splits in (1, 4):
            got = triton_ops.paged_attention(case.query, case.key_cache, case.value_cache, case.meta,
                                             case.scale, window, splits, sinks=sinks)
            torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
