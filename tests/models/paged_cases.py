"""Random paged-attention scenarios and a dense float64 oracle, shared by the attention tests.

A case scatters each request's context K/V into shuffled, non-contiguous blocks of a pool
filled with garbage, so any read outside a request's context shows up in the result.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.models.attention import make_attention_metadata
from deepinfer_kit.models.records import AttentionMetadata

HEAD_LAYOUTS = [(4, 4), (6, 2), (6, 3), (8, 1), (3, 1), (4, 2)]


@dataclass
class PagedCase:
    query: torch.Tensor  # [T, Hq, D]
    key_cache: torch.Tensor  # [NB, P, Hkv, D]
    value_cache: torch.Tensor
    meta: AttentionMetadata
    keys: list[torch.Tensor]  # per request [S, Hkv, D], dense
    values: list[torch.Tensor]
    scale: float


def random_lengths(rng: random.Random, num_requests: int, max_ctx: int = 80) -> list[tuple[int, int]]:
    """``(query_len, seq_len)`` pairs mixing every kind of request."""
    out = []
    for _ in range(num_requests):
        kind = rng.choice(["prefill", "chunk", "decode", "multi", "edge"])
        if kind == "prefill":
            s = rng.randint(1, max_ctx)
            out.append((s, s))
        elif kind == "chunk":
            q = rng.randint(2, max_ctx // 2)
            out.append((q, q + rng.randint(1, max_ctx // 2)))
        elif kind == "decode":
            out.append((1, rng.randint(1, max_ctx)))
        elif kind == "multi":
            q = rng.randint(2, 8)
            out.append((q, q + rng.randint(0, max_ctx - 8)))
        else:  # around the batched/looped boundary of the reference
            q = rng.choice([15, 16, 17])
            out.append((q, q + rng.randint(0, 20)))
    return out


def make_case(
    lengths: list[tuple[int, int]],
    *,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
) -> PagedCase:
    """Write every request's context through ``PagedKVCache.write`` into shuffled blocks."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = [-(-s // block_size) for _, s in lengths]
    pool = list(range(sum(need) + spare_blocks))
    rng.shuffle(pool)
    tables, at = [], 0
    for n in need:
        tables.append(pool[at : at + n])
        at += n
    cache = PagedKVCache(
        1, len(pool), block_size, num_kv_heads, head_dim, dtype=dtype, device=device, impl="ref"
    )
    garbage = torch.randn(cache.key_cache(0).shape, generator=gen) * 50
    cache.key_cache(0).copy_(garbage)
    cache.value_cache(0).copy_(garbage.flip(0))
    keys, values = [], []
    for (_, s), table in zip(lengths, tables):
        k = torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype)
        ctx = make_attention_metadata([s], [s], [table], block_size)
        cache.write(0, k.to(device), v.to(device), ctx.slot_mapping.to(device))
        keys.append(k)
        values.append(v)
    meta = make_attention_metadata(
        [q for q, _ in lengths], [s for _, s in lengths], tables, block_size, device
    )
    total = sum(q for q, _ in lengths)
    query = torch.randn(total, num_heads, head_dim, generator=gen).to(dtype).to(device)
    return PagedCase(
        query, cache.key_cache(0), cache.value_cache(0), meta, keys, values, head_dim**-0.5
    )


def dense_attention(case: PagedCase, sliding_window: int | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Plain causal attention per request on the unpaged K/V, in float64: ``[T, Hq, D]``;
    ``sinks`` ``[Hq]``: each head's softmax also holds ``exp(sinks[h])`` (a valueless key)."""
    outs = []
    start = 0
    for q_len, k, v in zip(case.meta.query_lens_host, case.keys, case.values):
        q = case.query[start : start + q_len].double().cpu()
        start += q_len
        s = k.shape[0]
        groups = q.shape[1] // k.shape[1]
        kk = k.double().repeat_interleave(groups, dim=1)
        vv = v.double().repeat_interleave(groups, dim=1)
        scores = torch.einsum("qhd,shd->hqs", q, kk) * case.scale
        pos = torch.arange(s - q_len, s)[:, None]
        keys = torch.arange(s)[None, :]
        allowed = keys <= pos
        if sliding_window is not None:
            allowed &= keys > pos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            sink = sinks.double().cpu()[:, None, None].expand(-1, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        outs.append(torch.einsum("hqs,shd->qhd", probs, vv))
    return torch.cat(outs)
