"""Prefix-cache benchmark: a shared-prefix, multi-turn trace replayed through each KV
cache manager (match + allocate + decode-allocate + publish + free), reporting hit rate
and requests per second against a naive exact-LRU model run in the same process.

Peers (imported on CPU when available): vLLM's v1 ``KVCacheManager`` with its default
sha256 block hashing, and SGLang's ``RadixCache`` with its paged allocator. A peer that
cannot be imported is skipped with the reason printed.

    .venv/bin/python benchmarks/bench_prefix_cache.py [--quick] [--requests N] [--repeat R]
"""

from __future__ import annotations

import argparse
import gc
import importlib.abc
import importlib.machinery
import random
import sys
import time
import types
from array import array
from collections.abc import Callable
from typing import Any

from deepinfer_kit.cache import (
    BlockKVCacheManager,
    FreeListBlockAllocator,
    HashChainPrefixIndex,
    RadixPrefixIndex,
)
from deepinfer_kit.testing.lru_reference import ExactLRUPrefixCache
from deepinfer_kit.request import Request
from deepinfer_kit.sample.params import SamplingParams

# One request: (id, prompt tokens, output tokens, context). The request computes the
# prompt and len(output) - 1 decode tokens (the last sampled token is never fed back).
Trace = list[tuple[str, list[int], list[int], str | None]]
Replay = Callable[[Trace, int, int], list[int]]  # -> cached prompt tokens per request


def make_trace(seed: int, num_requests: int, num_system: int) -> Trace:
    """Conversations over a few hundred system prompts (Zipf popularity); each turn's
    prompt is the conversation so far plus a new user message; 10% of conversations
    carry a tenant cache salt."""
    rng = random.Random(seed)
    vocab = 32000
    systems = [[rng.randrange(vocab) for _ in range(rng.randint(100, 700))] for _ in range(num_system)]
    weights = [1.0 / (i + 1) ** 0.9 for i in range(num_system)]
    active: list[dict[str, Any]] = []
    trace: Trace = []
    for i in range(num_requests):
        if not active or rng.random() < 0.3:
            sys_prompt = rng.choices(systems, weights)[0]
            salt = f"tenant-{rng.randrange(4)}" if rng.random() < 0.1 else None
            active.append({"history": list(sys_prompt), "turns": rng.randint(1, 8), "salt": salt})
        conv = rng.choice(active)
        prompt = conv["history"] + [rng.randrange(vocab) for _ in range(rng.randint(20, 200))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(10, 150))]
        trace.append((f"r{i}", prompt, output, conv["salt"]))
        conv["history"] = prompt + output
        conv["turns"] -= 1
        if conv["turns"] == 0 or len(conv["history"]) > 3500:
            active.remove(conv)
    return trace


def replay_ours(make_index: Callable[[int], Any]) -> Replay:
    def run(trace: Trace, num_blocks: int, P: int) -> list[int]:
        index = make_index(P)
        m = BlockKVCacheManager(FreeListBlockAllocator(num_blocks, P), index)
        params = SamplingParams()
        hits = []
        for rid, prompt, output, salt in trace:
            r = Request(rid, prompt, params, cache_context=salt)
            cached = m.match_prefix(r)
            m.allocate(r, len(prompt) - cached, cached)
            r.num_computed_tokens = n = len(prompt)
            m.cache_full_blocks(r, n)
            append = r.all_token_ids.append
            for tok in output[:-1]:
                append(tok)
                m.allocate(r, 1)
                n += 1
                r.num_computed_tokens = n
                m.cache_full_blocks(r, n)
            m.free(r)
            hits.append(cached)
        return hits

    return run


def replay_reference(trace: Trace, num_blocks: int, P: int) -> list[int]:
    ref = ExactLRUPrefixCache(num_blocks, P)
    hits = []
    for rid, prompt, output, salt in trace:
        tokens = list(prompt)
        cached = ref.match_prefix(tokens, salt)
        ref.allocate(rid, tokens, salt, 0, len(tokens) - cached, cached)
        n = len(tokens)
        ref.publish(rid, tokens, salt, n)
        for tok in output[:-1]:
            tokens.append(tok)
            ref.allocate(rid, tokens, salt, n, 1)
            n += 1
            ref.publish(rid, tokens, salt, n)
        ref.free(rid)
        hits.append(cached)
    return hits


def load_vllm() -> Replay:
    import torch
    from vllm.sampling_params import SamplingParams as VSamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request as VRequest

    def run(trace: Trace, num_blocks: int, P: int) -> list[int]:
        init_none_hash(sha256)
        spec = FullAttentionSpec(block_size=P, num_kv_heads=1, head_size=1, dtype=torch.float16)
        # vLLM reserves one null block.
        config = KVCacheConfig(num_blocks + 1, [], [KVCacheGroupSpec(["layer0"], spec)])
        m = KVCacheManager(
            config, max_model_len=1 << 16, scheduler_block_size=P, hash_block_size=P,
            enable_caching=True,
        )
        hasher = get_request_block_hasher(P, sha256)
        params = VSamplingParams(max_tokens=1 << 16)
        hits = []
        for rid, prompt, output, salt in trace:
            r = VRequest(rid, prompt, params, None, block_hasher=hasher, cache_salt=salt)
            blocks, cached = m.get_computed_blocks(r)[:2]
            if m.allocate_slots(r, len(prompt) - cached, cached, blocks) is None:
                raise RuntimeError("vLLM: out of blocks")
            r.num_computed_tokens = len(prompt)
            for tok in output[:-1]:
                r.append_output_token_ids(tok)
                if m.allocate_slots(r, 1) is None:
                    raise RuntimeError("vLLM: out of blocks")
                r.num_computed_tokens += 1
            m.free(r)
            hits.append(cached)
        return hits

    return run


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty stand-ins for ``torchvision`` (imported by SGLang's multimodal configs at
    import time; no CPU build matching this torch is on PyPI). Nothing here calls it."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        class Stub(types.ModuleType):
            def __getattr__(self, attr: str) -> Any:
                if attr.startswith("__"):
                    raise AttributeError(attr)
                return type(attr, (), {})

        return Stub(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []


def load_sglang() -> Replay:
    import torch
    import transformers.utils.import_utils  # noqa: F401  (decides torchvision is absent first)

    finder = _StubFinder()
    if importlib.util.find_spec("torchvision") is None:
        sys.meta_path.insert(0, finder)
    try:
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import (
            EvictParams,
            InsertParams,
            MatchPrefixParams,
        )
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    finally:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)

    def run(trace: Trace, num_blocks: int, P: int) -> list[int]:
        alloc = PagedTokenToKVPoolAllocator(
            size=num_blocks * P, page_size=P, dtype=torch.float16, device="cpu",
            kvcache=None, need_sort=False,
        )
        cache = RadixCache.create_simulated(mock_allocator=alloc, page_size=P)

        def take(num_tokens: int) -> Any:
            out = alloc.alloc(num_tokens)
            if out is None:
                cache.evict(EvictParams(num_tokens=num_tokens - alloc.available_size()))
                out = alloc.alloc(num_tokens)
                if out is None:
                    raise RuntimeError("SGLang: out of pages")
            return out

        def insert(tokens: list[int], kv: Any, protected: int, node: Any, salt: Any) -> tuple[Any, int]:
            """Publish the aligned prefix, free the duplicates, move the lock (like
            SGLang's cache_unfinished_req / cache_finished_req)."""
            aligned = len(tokens) // P * P
            key = RadixKey(array("q", tokens[:aligned]), cache_salt=salt)
            res = cache.insert(InsertParams(key=key, value=kv[:aligned]))
            if res.prefix_len > protected:
                alloc.free(kv[protected : res.prefix_len])
            new = cache.match_prefix(MatchPrefixParams(key=key))
            kv[:aligned] = cache.path_device_indices(new.last_device_node)
            cache.inc_lock_ref(new.last_device_node)
            cache.dec_lock_ref(node)
            return new.last_device_node, aligned

        hits = []
        for _rid, prompt, output, salt in trace:
            key = RadixKey(array("q", prompt), cache_salt=salt, limit=len(prompt) - 1)
            match = cache.match_prefix(MatchPrefixParams(key=key))
            cached, node = match.device_prefix_len, match.last_device_node
            cache.inc_lock_ref(node)
            need = -(-(len(prompt) - cached) // P) * P
            kv = torch.cat([cache.path_device_indices(node), take(need)])
            node, protected = insert(prompt, kv, cached, node, salt)
            tokens = list(prompt)
            for tok in output[:-1]:
                if len(tokens) == len(kv):
                    kv = torch.cat([kv, take(P)])
                tokens.append(tok)
            node, protected = insert(tokens, kv, protected, node, salt)
            alloc.free(kv[protected:])
            cache.dec_lock_ref(node)
            hits.append(cached)
        return hits

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small trace for a smoke run")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-peers", action="store_true", help="skip vLLM and SGLang")
    parser.add_argument("--repeat", type=int, default=None, help="rounds; best time kept")
    args = parser.parse_args()
    num_requests = args.requests or (300 if args.quick else 3000)
    P = args.block_size
    args.repeat = args.repeat or (1 if args.quick else 3)
    trace = make_trace(args.seed, num_requests, num_system=40 if args.quick else 300)
    longest = max(-(-(len(p) + len(o)) // P) for _, p, o, _ in trace)
    distinct = len({(s, tuple(p[: (i + 1) * P])) for _, p, _, s in trace for i in range(len(p) // P)})
    num_blocks = max(distinct // 4, 2 * longest)
    print(
        f"trace: {len(trace)} requests, {sum(len(p) for _, p, _, _ in trace)} prompt tokens, "
        f"{sum(len(o) - 1 for _, _, o, _ in trace)} decode tokens, {distinct} distinct prompt "
        f"blocks; pool {num_blocks} blocks of {P} tokens"
    )

    runners: list[tuple[str, Replay | None, str]] = [
        ("exact-LRU model (naive baseline)", replay_reference, ""),
        ("deepinfer hash chain", replay_ours(lambda p: HashChainPrefixIndex(p)), ""),
        ("deepinfer radix", replay_ours(lambda p: RadixPrefixIndex(p)), ""),
    ]
    if not args.no_peers:
        for name, loader in (("vLLM v1 KVCacheManager (sha256)", load_vllm), ("SGLang RadixCache", load_sglang)):
            try:
                runners.append((name, loader(), ""))
            except Exception as exc:  # noqa: BLE001 - a peer that cannot import is skipped
                runners.append((name, None, f"{type(exc).__name__}: {exc}"))

    for name, run, reason in runners:
        if run is None:
            print(f"SKIPPED {name}: {reason}")
    results: dict[str, tuple[float, list[int]]] = {}
    for _ in range(args.repeat):  # interleaved rounds; the best time of each is kept
        for name, run, _reason in runners:
            if run is None:
                continue
            gc.collect()
            t0 = time.perf_counter()
            hits = run(trace, num_blocks, P)
            elapsed = time.perf_counter() - t0
            if name not in results or elapsed < results[name][0]:
                results[name] = (elapsed, hits)

    base_t, base_hits = results["exact-LRU model (naive baseline)"]
    total_prompt = sum(len(p) for _, p, _, _ in trace)
    print(f"\n{'manager':34} {'hit rate':>9} {'req/s':>9} {'x baseline':>10} {'x vLLM':>7} {'x SGLang':>8} {'differ':>6}")
    for name, (elapsed, hits) in results.items():
        ratios = [f"{base_t / elapsed:10.2f}"]
        for peer in ("vLLM v1 KVCacheManager (sha256)", "SGLang RadixCache"):
            ratios.append(f"{results[peer][0] / elapsed:7.2f}" if peer in results else f"{'n/a':>7}")
        differ = sum(1 for a, b in zip(hits, base_hits) if a != b)
        print(
            f"{name:34} {sum(hits) / total_prompt:9.4f} {len(trace) / elapsed:9.0f} "
            f"{ratios[0]} {ratios[1]} {ratios[2]:>8} {differ:6d}"
        )
    print(f"\nhit rate: cached prompt tokens / prompt tokens; req/s: requests replayed per "
          f"second, best of {args.repeat}; differ: requests whose cached length differs from "
          f"the exact-LRU model")


if __name__ == "__main__":
    main()
