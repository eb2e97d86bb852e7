"""PagedAttention (torch reference) against dense causal attention on unpaged tensors."""

from __future__ import annotations

import dataclasses
import random

import attrs
import pytest
import torch
from paged_cases import HEAD_LAYOUTS, dense_attention, make_case, random_lengths

from deepinfer_kit.errors import ConfigError, DeviceUnavailableError, InvariantError
from deepinfer_kit.models.attention import PagedAttention


def _run(case, *, sliding_window=None) -> torch.Tensor:
    hq, hkv, d = case.query.shape[1], case.key_cache.shape[2], case.query.shape[2]
    attn = PagedAttention(hq, hkv, d, case.scale, impl="ref", sliding_window=sliding_window)
    return attn(case.query, case.key_cache, case.value_cache, case.meta)


@pytest.mark.parametrize("seed", range(16))
def test_random_mixed_batches_match_dense(seed: int) -> None:
    rng = random.Random(seed)
    hq, hkv = rng.choice(HEAD_LAYOUTS)
    lengths = random_lengths(rng, rng.randint(1, 7))
    case = make_case(
        lengths, block_size=rng.choice([16, 32, 5]), num_heads=hq, num_kv_heads=hkv, seed=seed
    )
    torch.testing.assert_close(_run(case).double(), dense_attention(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "lengths",
    [
        pytest.param([(1, 1), (1, 40), (1, 17), (1, 33)], id="decode-only"),
        pytest.param([(5, 5), (40, 40), (1, 1)], id="prefill-from-zero"),
        pytest.param([(20, 50), (17, 64), (33, 34)], id="chunked-prefill-after-prefix"),
        pytest.param([(2, 30), (8, 8), (4, 61), (3, 3)], id="multi-token-decode"),
        pytest.param([(1, 64), (30, 30), (4, 20), (25, 70), (1, 2)], id="all-kinds-mixed"),
        pytest.param([(16, 16), (17, 32), (16, 48)], id="batched-looped-boundary"),
    ],
)
@pytest.mark.parametrize("block_size", [16, 32])
def test_named_layouts(lengths: list[tuple[int, int]], block_size: int) -> None:
    case = make_case(lengths, block_size=block_size, num_heads=6, num_kv_heads=2, seed=7)
    torch.testing.assert_close(_run(case).double(), dense_attention(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 4, 16, 100])
def test_sliding_window_matches_dense(window: int) -> None:
    lengths = [(1, 40), (30, 30), (4, 37), (20, 45)]
    case = make_case(lengths, block_size=16, num_heads=4, num_kv_heads=2, seed=window)
    expected = dense_attention(case, sliding_window=window)
    got = _run(case, sliding_window=window).double()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    if window < 30:  # a window that cuts the context must change the result
        assert not torch.allclose(got, dense_attention(case), atol=1e-3)


@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("window", [1, 3, 9])
def test_a_window_reads_only_its_blocks_and_still_matches_dense(window: int, table_dtype: torch.dtype) -> None:
    """Contexts many blocks past the window: the reference gathers only the blocks from the
    first new token's window on (decodes, short verify queries, a long prefill chunk), with
    the tables' int32 or int64 ids; a table row wider than a request's blocks is padded."""
    lengths = [(1, 97), (3, 60), (1, 5), (6, 33), (40, 89), (20, 63), (17, 64), (2, 2)]
    case = make_case(lengths, block_size=4, num_heads=4, num_kv_heads=2, seed=window)
    case = dataclasses.replace(case, meta=attrs.evolve(case.meta, block_tables=case.meta.block_tables.to(table_dtype)))
    torch.testing.assert_close(_run(case, sliding_window=window).double(), dense_attention(case, sliding_window=window),
                               atol=1e-5, rtol=1e-5)


def test_bf16_within_tolerance() -> None:
    lengths = [(1, 50), (24, 24), (3, 40)]
    case = make_case(
        lengths, block_size=16, num_heads=4, num_kv_heads=1, dtype=torch.bfloat16, seed=3
    )
    got = _run(case)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), dense_attention(case), atol=2e-2, rtol=2e-2)


def test_request_output_does_not_depend_on_batch() -> None:
    lengths = [(1, 30), (3, 40), (20, 20), (1, 9)]
    together = make_case(lengths, block_size=16, num_heads=4, num_kv_heads=2, seed=11)
    out = _run(together)
    start = 0
    for r, (q, _) in enumerate(lengths):
        alone = make_case([lengths[r]], block_size=16, num_heads=4, num_kv_heads=2, seed=11)
        alone.query = together.query[start : start + q]
        alone.keys, alone.values = [together.keys[r]], [together.values[r]]
        torch.testing.assert_close(
            out[start : start + q].double(), dense_attention(alone), atol=1e-5, rtol=1e-5
        )
        start += q


def test_call_mutates_nothing() -> None:
    case = make_case([(1, 30), (20, 20)], block_size=16, num_heads=4, num_kv_heads=2)
    before = (case.query.clone(), case.key_cache.clone(), case.value_cache.clone())
    _run(case)
    assert torch.equal(case.query, before[0])
    assert torch.equal(case.key_cache, before[1])
    assert torch.equal(case.value_cache, before[2])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_heads": 6, "num_kv_heads": 4}, "num_heads"),
        ({"num_heads": 0}, "num_heads"),
        ({"head_dim": -1}, "head_dim"),
        ({"scale": 0.0}, "scale"),
        ({"scale": float("nan")}, "scale"),
        ({"impl": "cuda"}, "impl"),
        ({"sliding_window": 0}, "sliding_window"),
    ],
)
def test_bad_config_names_the_field(kwargs: dict[str, object], field: str) -> None:
    args: dict[str, object] = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "scale": 0.3}
    args.update(kwargs)
    with pytest.raises(ConfigError, match=field):
        PagedAttention(**args)  # type: ignore[arg-type]


def test_triton_without_cuda_or_interpreter_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(DeviceUnavailableError):
        PagedAttention(4, 2, 8, 0.3, impl="triton")


def test_auto_picks_reference_on_cpu() -> None:
    assert PagedAttention(4, 2, 8, 0.3, device="cpu").impl == "ref"


def test_shape_mismatch_is_an_invariant_error() -> None:
    case = make_case([(1, 10)], block_size=16, num_heads=4, num_kv_heads=2)
    attn = PagedAttention(4, 1, 16, 0.25, impl="ref")
    with pytest.raises(InvariantError, match="Hkv=1"):
        attn(case.query, case.key_cache, case.value_cache, case.meta)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("lengths", [
    pytest.param([(1, 40), (1, 3), (2, 19)], id="decode-and-verify"),  # the batched (padded) path
    pytest.param([(30, 30), (20, 45)], id="prefill"),  # one request at a time
])
def test_sinks_match_dense(lengths: list[tuple[int, int]], window: int | None) -> None:
    from paged_cases import dense_attention, make_case

    from deepinfer_kit.models.attention import ref_ops

    case = make_case(lengths, block_size=8, num_heads=6, num_kv_heads=2, seed=3)
    sinks = torch.tensor([-1.0, 0.0, 2.5, 1.0, -3.0, 4.0])
    got = ref_ops.paged_attention(case.query, case.key_cache, case.value_cache, case.meta, case.scale,
                                  window, sinks=sinks).double()
    torch.testing.assert_close(got, dense_attention(case, window, sinks), atol=1e-5, rtol=1e-5)
    plain = dense_attention(case, window)
    assert not torch.allclose(got, plain, atol=1e-3)  # the sinks take weight off every key


def test_paged_attention_takes_sinks_on_both_implementations() -> None:
    pytest.importorskip("triton")
    case = make_case([(1, 30), (5, 12)], block_size=8, num_heads=4, num_kv_heads=2, seed=5)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    want = dense_attention(case, None, sinks)
    impls = ["ref"] + (["triton"] if torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET") else [])
    for impl in impls:
        attn = PagedAttention(4, 2, case.query.shape[2], case.scale, impl=impl, sinks=sinks)
        got = attn(case.query, case.key_cache, case.value_cache, case.meta).double()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="sinks"):
        PagedAttention(4, 2, 16, 0.25, sinks=torch.zeros(3))
    with pytest.raises(ConfigError, match="sinks"):
        PagedAttention(4, 2, 16, 0.25, sinks=torch.zeros(4), batch_invariant=True)
