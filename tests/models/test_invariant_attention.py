"""The batch-invariant reference attention (``attention.invariant_ref``): against the dense
float64 oracle, and bitwise the same row whatever the batch, the request's chunking
(decode row, verify chunk, prefill chunk) and the context other rows in the call need."""

from __future__ import annotations

import random

import pytest
import torch
from paged_cases import HEAD_LAYOUTS, dense_attention, make_case, random_lengths

from deepinfer_kit.models.attention import PagedAttention, make_attention_metadata
from deepinfer_kit.models.attention.invariant_ref import CHUNK_KEYS, paged_attention


def _run(case, *, sliding_window=None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    hq, hkv, d = case.query.shape[1], case.key_cache.shape[2], case.query.shape[2]
    attn = PagedAttention(hq, hkv, d, case.scale, impl="ref", sliding_window=sliding_window,
                          batch_invariant=True)
    return attn(case.query, case.key_cache, case.value_cache, case.meta)


@pytest.mark.parametrize("seed", range(12))
def test_random_mixed_batches_match_dense(seed: int) -> None:
    rng = random.Random(seed)
    hq, hkv = rng.choice(HEAD_LAYOUTS)
    lengths = random_lengths(rng, rng.randint(1, 7), max_ctx=200)
    case = make_case(lengths, block_size=rng.choice([16, 32, 5]), num_heads=hq, num_kv_heads=hkv, seed=seed)
    torch.testing.assert_close(_run(case).double(), dense_attention(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 4, 70, 300])
def test_sliding_window_matches_dense(window: int) -> None:
    lengths = [(1, 140), (30, 30), (4, 137), (20, 145)]
    case = make_case(lengths, block_size=16, num_heads=4, num_kv_heads=2, seed=window)
    got = _run(case, sliding_window=window).double()
    torch.testing.assert_close(got, dense_attention(case, sliding_window=window), atol=1e-5, rtol=1e-5)


def test_bf16_within_tolerance() -> None:
    case = make_case([(1, 150), (24, 24), (3, 40)], block_size=16, num_heads=4, num_kv_heads=1,
                     dtype=torch.bfloat16, seed=3)
    got = _run(case)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), dense_attention(case), atol=2e-2, rtol=2e-2)


class _Pool:
    """A KV pool holding one target context (shuffled blocks) and others' contexts, with the
    target's query vectors at every position: metas over it run the same rows in different
    company and chunkings."""

    def __init__(self, target_len: int, *, block: int = 8, hq: int = 4, hkv: int = 2, d: int = 16) -> None:
        gen = torch.Generator().manual_seed(5)
        self.block, self.hq, self.d = block, hq, d
        self.num_blocks = 256
        order = torch.randperm(self.num_blocks, generator=gen).tolist()
        self.free = order
        self.keys = torch.randn(self.num_blocks, block, hkv, d, generator=gen)
        self.values = torch.randn(self.num_blocks, block, hkv, d, generator=gen)
        self.target = self.take(target_len)
        self.target_q = torch.randn(target_len, hq, d, generator=gen)
        self.gen = gen

    def take(self, length: int) -> list[int]:
        n = -(-length // self.block)
        blocks, self.free = self.free[:n], self.free[n:]
        return blocks

    def run(self, target_rows: tuple[int, int], others: list[tuple[int, int]]) -> torch.Tensor:
        """The target's rows for positions ``[lo, hi)`` (its context ``hi``) among
        ``others`` ``(query_len, seq_len)`` (placed before and after it); returns the
        target's output rows."""
        lo, hi = target_rows
        split = len(others) // 2
        lens = others[:split] + [(hi - lo, hi)] + others[split:]
        tables = [self.take(s) for _, s in others[:split]] + [self.target] + \
                 [self.take(s) for _, s in others[split:]]
        meta = make_attention_metadata([q for q, _ in lens], [s for _, s in lens], tables, self.block)
        parts = [torch.randn(q, self.hq, self.d, generator=self.gen) for q, _ in others]
        query = torch.cat(parts[:split] + [self.target_q[lo:hi]] + parts[split:])
        out = paged_attention(query, self.keys, self.values, meta, self.d ** -0.5)
        start = sum(q for q, _ in others[:split])
        self.free += [b for t in tables if t is not self.target for b in t]
        return out[start:start + hi - lo]


def test_a_row_is_bitwise_the_same_in_any_batch_and_any_chunking() -> None:
    pool = _Pool(3 * CHUNK_KEYS + 37)
    n = 3 * CHUNK_KEYS + 37
    last = pool.run((n - 1, n), [])[0]  # a decode row, alone
    rng = random.Random(0)
    for _ in range(12):
        others = [(rng.choice([1, 1, 5, 30]), 0) for _ in range(rng.randint(0, 6))]
        others = [(q, q + rng.randint(0, 5 * CHUNK_KEYS)) for q, _ in others]
        lo = rng.choice([n - 1, n - 5, n - 17, n - 130, 0])  # decode, verify, prefill chunks
        rows = pool.run((lo, n), others)
        assert torch.equal(rows[-1], last), (lo, others)
    # an earlier position, as a verify row and as a decode row at its own context
    mid = 2 * CHUNK_KEYS + 3
    assert torch.equal(pool.run((mid - 3, n), [(1, 400)])[2], pool.run((mid - 1, mid), [])[0])
    assert torch.equal(pool.run((0, mid), [(7, 70)])[-1], pool.run((mid - 1, mid), [(1, 9)])[0])
