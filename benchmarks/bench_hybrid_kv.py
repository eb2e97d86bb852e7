"""The hybrid KV cache: KV bytes one sequence holds, and decode throughput, on a 5 local : 1
global model, against the same model keeping every token in every layer (same run).

1. **KV bytes per sequence** at ``--context`` tokens (default 4096) on a Gemma-3-1B-like
   layout (``--layers`` 24: 20 sliding layers with a ``--window`` of 512 and 4 full ones,
   5:1; 1 KV head of 256 in bf16), on the real ``HybridKVCacheManager``: one sequence
   prefilled in chunks of ``--chunk`` tokens, then decoded 64 tokens; after every step the
   blocks it holds in each group are read from the manager and priced with the layers of
   that group. Against the all-full cache (every layer holds every token).
2. **Decode throughput on CPU** of a tiny random 5:1 Qwen2 (``layer_types``; hidden 64,
   window ``--tiny-window``) at ``--tiny-context`` tokens (default 2048): ``--requests``
   requests of that many prompt tokens decode ``--new-tokens`` tokens, with the hybrid
   cache and with the same weights as a full-attention model (no sliding layers); tok/s from
   the median decode step (steps after every prompt is in) over ``--repeats`` runs, and
   the ratio.
3. **Prefix reuse** on a long-prefix multi-turn workload in the simulator (the real
   scheduler and managers): prompt tokens served from the cache, replayed and computed,
   every layer full vs the hybrid cache without and with bounded replay, in the same KV
   memory (a window of ``--replay-window`` tokens, whose replay bound fits a round).

    .venv/bin/python benchmarks/bench_hybrid_kv.py
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from deepinfer_kit import SamplingParams, build_engine
from deepinfer_kit.cache.hybrid_manager import HybridKVCacheManager
from deepinfer_kit.cache.layer_groups import KVLayout
from deepinfer_kit.cache.manager import BlockKVCacheManager
from deepinfer_kit.cache.records import CacheConfig
from deepinfer_kit.request import Request


def kv_bytes(args: argparse.Namespace) -> None:
    P = args.block_size
    windows = [None if (i + 1) % 6 == 0 else args.window for i in range(args.layers)]
    layout = KVLayout.from_windows(windows)
    per_layer_block = 2 * P * args.kv_heads * args.head_dim * 2  # K and V, bf16
    blocks = -(-(args.context + 64) // P) + 1
    inner = BlockKVCacheManager.create(CacheConfig(block_size=P, num_blocks=blocks))
    m = HybridKVCacheManager(inner, layout, layout.sliding_pool_blocks(P, 1, args.chunk))
    r = Request("r", [random.randrange(1000) for _ in range(args.context)], SamplingParams())
    peak = {g: 0 for g in range(layout.num_groups)}

    def note() -> None:
        peak[0] = max(peak[0], inner.num_blocks - inner.num_free_blocks)
        for g, wm in m.group_maps():
            peak[g] = max(peak[g], wm.num_held)

    while r.num_computed_tokens < args.context:
        n = min(args.chunk, args.context - r.num_computed_tokens)
        m.allocate(r, n)
        r.num_computed_tokens += n
        note()
    for t in range(64):
        r.all_token_ids.append(t)
        m.allocate(r, 1)
        r.num_computed_tokens += 1
        note()
    end_blocks = {0: inner.num_blocks - inner.num_free_blocks, **{g: wm.num_held for g, wm in m.group_maps()}}
    m.free(r)
    m.check_integrity(())

    def price(held: dict[int, int]) -> int:
        return sum(held[g] * len(layout.layers_of(g)) * per_layer_block for g in held)

    full = -(-(args.context + 64) // P) * args.layers * per_layer_block
    print(f"1. KV bytes per sequence at {args.context} + 64 decoded tokens, {args.layers} layers "
          f"({len(layout.layers_of(0))} full, {args.layers - len(layout.layers_of(0))} with window {args.window}), "
          f"blocks of {P}, {per_layer_block} bytes per layer-block, prefill chunks of {args.chunk}")
    print(f"   all-full cache: {full / 2**20:.1f} MiB")
    print(f"   hybrid, after the decode: {price(end_blocks) / 2**20:.1f} MiB = {price(end_blocks) / full:.3f}x "
          f"(blocks held per group {end_blocks})")
    print(f"   hybrid, peak during the prefill chunks: {price(peak) / 2**20:.1f} MiB = {price(peak) / full:.3f}x "
          f"(blocks {peak})")


def tiny_checkpoint(folder: Path, window: int | None, context: int, seed: int = 0) -> None:
    """A random Qwen2 of 5 sliding layers (``window``; ``None``: every layer full) to 1 full
    one, for contexts up to ``context`` tokens, saved to ``folder`` (bench_kv_tiers uses it too)."""
    import transformers as T

    from deepinfer_kit.models.config import ModelConfig  # noqa: F401  (the kit parses what is saved)

    kinds = ["sliding_attention"] * 5 + ["full_attention"]
    config = T.Qwen2Config(vocab_size=256, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=128, max_position_embeddings=context + 256,
                           use_sliding_window=window is not None, sliding_window=window or 4096,
                           max_window_layers=0, layer_types=kinds if window is not None else ["full_attention"] * 6)
    config.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(seed)
    T.Qwen2ForCausalLM(config).save_pretrained(folder)


def throughput(args: argparse.Namespace) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(args.tiny_context)] for _ in range(args.requests)]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, window in (("hybrid (window %d)" % args.tiny_window, args.tiny_window), ("full attention", None)):
            folder = Path(tmp) / name.split()[0]
            tiny_checkpoint(folder, window, args.tiny_context)
            engine = build_engine(model=str(folder), max_num_seqs=args.requests,
                                  max_model_len=args.tiny_context + args.new_tokens + 8,
                                  enable_prefix_caching=False)
            def decode_steps(tag: str) -> list[float]:
                """Per-step seconds of the steps after every prompt is in (pure decode)."""
                sp = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
                for i, p in enumerate(prompts):
                    engine.add_request(f"{tag}{i}", p, sp)
                times: list[float] = []
                while engine.has_unfinished_requests():
                    prefilling = any(r.num_computed_tokens < r.num_prompt_tokens
                                     for r in engine.scheduler.state.running) or engine.scheduler.state.waiting
                    t0 = time.perf_counter()
                    engine.step()
                    if not prefilling:
                        times.append(time.perf_counter() - t0)
                engine.flush()
                return times

            decode_steps("warm")
            steps = sorted(s for k in range(args.repeats) for s in decode_steps(f"run{k}-"))
            best = steps[len(steps) // 2] / len(prompts)  # median seconds per token
            engine.check_idle()
            results[name] = 1.0 / best
    hybrid, full = results.values()
    print(f"2. decode on CPU, {args.requests} requests x {args.tiny_context} prompt tokens, "
          f"{args.new_tokens} new tokens, tiny 5:1 Qwen2 (torch threads {torch.get_num_threads()}); the median "
          f"of the decode steps (every prompt in) over {args.repeats} runs")
    for name, tok_s in results.items():
        print(f"   {name:24} {tok_s:9.1f} tok/s")
    print(f"   hybrid / full attention: {hybrid / full:.2f}x")


def prefix_reuse(args: argparse.Namespace) -> None:
    """Part 3: a long-prefix multi-turn workload in the simulator (the real scheduler and
    cache managers, the H200 analytic cost), every layer full vs the hybrid cache without
    and with bounded replay, in the same KV memory. Prefill tokens computed = prompt tokens
    - tokens served from the cache + tokens a replay recomputed."""
    import attrs

    from deepinfer_kit.engine.config import EngineConfig
    from deepinfer_kit.sim.build import build_simulator
    from deepinfer_kit.sim.cost_analytic import H200, QWEN3_1_7B, AnalyticCost
    from deepinfer_kit.sim.lengths import LengthDist
    from deepinfer_kit.sim.workload import WorkloadConfig, generate

    windowed = attrs.evolve(QWEN3_1_7B, num_layers=args.layers, sliding_window=args.replay_window,
                            sliding_layers=args.layers - args.layers // 6)
    full = attrs.evolve(windowed, sliding_window=None, sliding_layers=0)
    reqs = generate(WorkloadConfig(
        num_requests=args.sim_requests, rate=args.sim_rate, seed=1, shared_fraction=0.8,
        shared_prefix_len=3000, num_shared_prefixes=8, multi_turn_fraction=0.7, turns=4,
        followup_len=LengthDist("lognormal", 200, 0.5, 8, 2000), think_time=2.0,
        prompt_len=LengthDist("lognormal", 4000, 0.3, 3100, 12000),
        output_len=LengthDist("lognormal", 150, 0.5, 8, 1000)))
    prompt = sum(r.prompt_len for r in reqs)
    base = EngineConfig(kv_cache_memory_mb=args.sim_memory_mb, max_model_len=32768, max_num_seqs=64)
    print(f"3. prefix reuse on a long-prefix multi-turn workload (simulator, {len(reqs)} requests, {prompt:,} prompt "
          f"tokens: 8 system prompts of 3000 tokens, 70% of conversations 4 turns; {args.sim_memory_mb} MiB of KV, "
          f"max_num_seqs 64; {windowed.sliding_layers} of {args.layers} layers sliding over {args.replay_window} "
          f"tokens; the H200 analytic cost)")
    print(f"   {'cache':28} {'from cache':>11} {'replayed':>9} {'computed':>10} {'out tok/s':>10} {'TTFT p50 ms':>12}")
    rows = (("every layer full", full, base), ("hybrid, no replay", windowed, attrs.evolve(base, bounded_replay=False)),
            ("hybrid, bounded replay", windowed, base))
    for name, model, config in rows:
        sim = build_simulator(config, AnalyticCost(model, H200), model)
        report = sim.run(reqs)
        sim.cache.check_integrity(())
        s = report.summary()
        cached = round(report.prefix_hit_rate * prompt)
        replayed = sim.cache.window_stats.replayed_tokens if isinstance(sim.cache, HybridKVCacheManager) else 0
        print(f"   {name:28} {cached:11,} {replayed:9,} {prompt - cached + replayed:10,} {s['out_tok_per_s']:10,.0f} "
              f"{s['ttft_p50_ms']:12,.1f}")
        if isinstance(sim.cache, HybridKVCacheManager):
            w = sim.cache.window_stats
            print(f"   {'':28} (replay bound {sim.cache.layout.replay_bound} tokens; {w.replays} replays; hit tokens "
                  f"the windows cost: {w.full_hit_tokens - w.kept_tokens:,} over {w.queries} matches)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--tiny-context", type=int, default=2048)
    parser.add_argument("--tiny-window", type=int, default=128)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--sim-requests", type=int, default=600)
    parser.add_argument("--sim-rate", type=float, default=4.0)
    parser.add_argument("--sim-memory-mb", type=int, default=16 * 1024)
    parser.add_argument("--replay-window", type=int, default=64,
                        help="part 3's window: its replay bound (20 x 63 + 64) fits a round")
    args = parser.parse_args()
    kv_bytes(args)
    if not args.skip_throughput:
        throughput(args)
    prefix_reuse(args)


if __name__ == "__main__":
    main()
