"""Paged decode attention vs gathering the cache into contiguous tensors + SDPA.

A decode step of R requests with mixed context lengths, K/V scattered over shuffled blocks.
Baselines, measured in the same run: (a) per request, gather its K/V contiguous and call
``scaled_dot_product_attention``; (b) gather every request padded to the longest context
and call SDPA once with a mask. Runs the torch reference on CPU, and the Triton kernel too
when CUDA is present. Prints ms per call and each path's speed relative to baseline (a).

On CUDA a second table times the per-layer q/k RMSNorm + RoPE + KV-cache write of the same
decode step: the unfused ops the model runs without the kernel (torch norm, torch rotation,
the Triton cache write; 3 kernels and their temporaries) against the fused Triton kernel
(one launch), as a ratio. On CPU it prints that it was skipped.

    .venv/bin/python benchmarks/bench_attention.py [--quick] [--requests 64]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.models.attention import PagedAttention, make_attention_metadata
from deepinfer_kit.models.fused_ops import rms_norm
from deepinfer_kit.models.records import AttentionMetadata
from deepinfer_kit.models.rope import apply_rotary
from deepinfer_kit.models.rope_kv import rope_kv_write


def _time_interleaved(
    paths: dict[str, Callable[[], torch.Tensor]], repeats: int, device: torch.device
) -> dict[str, float]:
    """Best ms per call of each path; the paths take turns, so load changes hit all alike."""
    best = {name: float("inf") for name in paths}
    for fn in paths.values():
        fn()  # warm-up (and Triton compile)
    for _ in range(repeats):
        for name, fn in paths.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            best[name] = min(best[name], time.perf_counter() - t0)
    return {name: t * 1e3 for name, t in best.items()}


def _gathered(cache: PagedKVCache, meta: AttentionMetadata, r: int) -> tuple[torch.Tensor, ...]:
    s = meta.seq_lens_host[r]
    blocks = meta.block_tables[r, : -(-s // cache.block_size)].long()
    k = cache.key_cache(0)[blocks].flatten(0, 1)[:s]
    v = cache.value_cache(0)[blocks].flatten(0, 1)[:s]
    return k, v


def per_request_sdpa(q: torch.Tensor, cache: PagedKVCache, meta: AttentionMetadata) -> torch.Tensor:
    """Baseline (a): gather each request's context, one SDPA call per request."""
    outs = []
    for r in range(meta.num_requests):
        k, v = _gathered(cache, meta, r)
        res = F.scaled_dot_product_attention(
            q[r : r + 1].transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            enable_gqa=True,
        )
        outs.append(res[0].transpose(0, 1))
    return torch.cat(outs)


def padded_sdpa(q: torch.Tensor, cache: PagedKVCache, meta: AttentionMetadata) -> torch.Tensor:
    """Baseline (b): gather every context padded to the longest, one masked SDPA call."""
    smax = meta.max_seq_len
    ks, vs = zip(*(_gathered(cache, meta, r) for r in range(meta.num_requests)))
    k = torch.nn.utils.rnn.pad_sequence(list(ks), batch_first=True).transpose(1, 2)
    v = torch.nn.utils.rnn.pad_sequence(list(vs), batch_first=True).transpose(1, 2)
    mask = torch.arange(smax, device=q.device)[None, :] < meta.seq_lens[:, None]
    res = F.scaled_dot_product_attention(
        q[:, :, None, :], k, v, attn_mask=mask[:, None, None, :], enable_gqa=True
    )
    return res[:, :, 0, :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke run")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.requests, args.max_len, args.min_len, args.repeats = 8, 256, 16, 2
    torch.manual_seed(0)
    rng = random.Random(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    p = args.block_size
    seq_lens = [rng.randint(args.min_len, args.max_len) for _ in range(args.requests)]
    need = [-(-s // p) for s in seq_lens]
    pool = list(range(sum(need)))
    rng.shuffle(pool)
    tables = [pool[sum(need[:r]) : sum(need[: r + 1])] for r in range(args.requests)]
    cache = PagedKVCache(
        1, len(pool), p, args.kv_heads, args.head_dim, dtype=dtype, device=device
    )
    cache.key_cache(0).normal_()
    cache.value_cache(0).normal_()
    meta = make_attention_metadata([1] * args.requests, seq_lens, tables, p, device)
    q = torch.randn(args.requests, args.heads, args.head_dim, dtype=dtype, device=device)
    scale = args.head_dim**-0.5

    paths: dict[str, Callable[[], torch.Tensor]] = {
        "gather + SDPA per request (baseline)": lambda: per_request_sdpa(q, cache, meta),
        "gather padded + one SDPA": lambda: padded_sdpa(q, cache, meta),
    }
    impls = ["ref", "triton"] if device.type == "cuda" else ["ref"]
    for impl in impls:
        attn = PagedAttention(
            args.heads, args.kv_heads, args.head_dim, scale, impl=impl, device=device  # type: ignore[arg-type]
        )
        paths[f"PagedAttention impl={impl}"] = (
            lambda a=attn: a(q, cache.key_cache(0), cache.value_cache(0), meta)
        )

    expected = per_request_sdpa(q, cache, meta).float()
    print(
        f"decode attention: R={args.requests}, context {min(seq_lens)}..{max(seq_lens)} "
        f"(total {sum(seq_lens)} tokens), Hq={args.heads}, Hkv={args.kv_heads}, "
        f"D={args.head_dim}, P={p}, {dtype}, {device}, {torch.get_num_threads()} threads"
    )
    print(f"{'path':<40} {'ms/call':>9} {'speed vs baseline':>18} {'max |diff|':>11}")
    times = _time_interleaved(paths, args.repeats, device)
    base_ms = next(iter(times.values()))
    for name, fn in paths.items():
        ms = times[name]
        diff = (fn().float() - expected).abs().max().item()
        print(f"{name:<40} {ms:>9.2f} {base_ms / ms:>17.2f}x {diff:>11.2e}")
    rope_kv_table(cache, meta, args.heads, args.repeats)


def rope_kv_table(cache: PagedKVCache, meta: AttentionMetadata, heads: int, repeats: int) -> None:
    """The fused q/k norm + RoPE + KV write against the unfused ops, on one decode step."""
    if cache.device.type != "cuda":
        print("fused q/k norm + RoPE + KV write: skipped (CUDA only)")
        return
    from deepinfer_kit.models.rope_kv_triton import rope_kv_write as fused

    tokens, hkv, d, dtype = meta.num_requests, cache.num_kv_heads, cache.head_dim, cache.dtype
    qkv = torch.randn(tokens, (heads + 2 * hkv) * d, dtype=dtype, device=cache.device)
    weight = torch.rand(heads + hkv, d, dtype=dtype, device=cache.device) + 0.5
    angles = torch.rand(tokens, 1, d // 2, device=cache.device) * 100
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
    sin = torch.cat((-angles.sin(), angles.sin()), -1).to(dtype)
    slots = meta.slot_mapping
    keys, values = cache.slot_caches(0)

    def unfused() -> torch.Tensor:
        qk = qkv[:, : (heads + hkv) * d].view(tokens, heads + hkv, d)
        qk = apply_rotary(rms_norm(qk, weight, 1e-6), cos, sin)
        cache.write(0, qk[:, heads:], qkv[:, (heads + hkv) * d:].view(tokens, hkv, d), slots)
        return qk[:, :heads]

    paths: dict[str, Callable[[], torch.Tensor]] = {
        "unfused norm + rotate + write (baseline)": unfused,
        "fused Triton kernel": lambda: fused(qkv, weight, 1e-6, cos, sin, keys, values, slots, heads),
    }
    expected = rope_kv_write(qkv, weight, 1e-6, cos, sin, keys.clone(), values.clone(), slots,
                             heads).float()
    print(f"\nq/k norm + RoPE + KV write: T={tokens}, Hq={heads}, Hkv={hkv}, D={d}, {dtype}")
    print(f"{'path':<40} {'ms/call':>9} {'speed vs baseline':>18} {'max |diff|':>11}")
    times = _time_interleaved(paths, repeats, cache.device)
    base_ms = next(iter(times.values()))
    for name, fn in paths.items():
        diff = (fn().float() - expected).abs().max().item()
        print(f"{name:<40} {times[name]:>9.3f} {base_ms / times[name]:>17.2f}x {diff:>11.2e}")


if __name__ == "__main__":
    main()
