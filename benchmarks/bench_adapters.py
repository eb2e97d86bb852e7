"""Benchmark: the kit's components inside transformers' continuous batching and behind
vLLM's interfaces, against each peer's own classes, in the same run.

0. transformers ``generate_batch`` on a tiny random Qwen3 (CPU), FIFO scheduler against the
   kit's scheduler (registered through ``adapters.transformers``), each the fastest of
   ``--reps`` runs: 64 mixed-length requests (8..120 prompt tokens, 16 greedy tokens), and
   64 requests sharing a 96-token prefix (transformers' own prefix sharing on for FIFO, the
   kit's prefix cache for the kit). Tokens are checked identical. Runs without vLLM.
1. Sampler sweep (bench_sampler.py's ``--sweep`` rows: every row top-p 0.9, no top-k,
   temperatures {0.5, 1, 1.5} x nucleus widths): ``KitSampler.forward(logits, md)`` against
   vLLM's ``Sampler.forward(logits, md)`` on the same ``SamplingMetadata`` (no generators,
   vLLM's fastest CPU path: its native top-k/top-p sort). vLLM's sampler divides the logits
   in place, so both calls get a fresh clone of the logits (the same cost on both sides).
   Full: batch 256 x vocab 151,936, widths 10 / 100 / 1k / 10k / 60k; ``--quick``: batch 8 x
   vocab 32,000, widths 10 / 1k / 20k. Fastest of ``--reps`` back-to-back reps. The last
   column checks every kit token lies inside its row's nucleus.
2. KV cache manager: the 1,000-request Zipf trace of tests/adapters/test_adapter_vllm_kv.py
   driven through ``KitKVCacheManager`` and through vLLM's ``KVCacheManager`` separately
   (same calls, the hits asserted equal), wall time of each.

Needs vLLM's host classes: ``pip install --no-deps --target DIR vllm==0.33.0`` plus the
pure-Python modules it imports (docs/other_engines.md lists them), then
``PYTHONPATH=DIR .venv/bin/python benchmarks/bench_adapters.py [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "adapters"))

import bench_sampler as bs


def transformers_section(reps: int) -> None:
    """Print FIFO against the kit's scheduler inside ``generate_batch`` (see the module
    docstring)."""
    import logging
    import random

    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from deepinfer_kit.adapters.transformers import kit_scheduler

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024)
    model = Qwen3ForCausalLM(cfg).eval()
    model.config._attn_implementation = "sdpa"
    rng = random.Random(0)
    mixed = [[rng.randrange(1, 512) for _ in range(rng.randrange(8, 121))] for _ in range(64)]
    prefix = [rng.randrange(1, 512) for _ in range(96)]
    shared = [prefix + [rng.randrange(1, 512) for _ in range(rng.randrange(4, 33))] for _ in range(64)]
    gen = GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)

    def run(prompts: list[list[int]], scheduler: str) -> tuple[float, dict[str, list[int]]]:
        cb = ContinuousBatchingConfig(page_size=16, num_blocks=512, max_batch_tokens=256,
                                      scheduler_type=scheduler, use_async_batching=False)
        best, out = float("inf"), {}
        for _ in range(reps):
            start = time.perf_counter()
            res = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, warmup=False)
            best = min(best, time.perf_counter() - start)
            out = {k: list(v.generated_tokens) for k, v in res.items()}
        return best, out

    print(f"transformers generate_batch, tiny Qwen3 (4 layers, hidden 128), {torch.get_num_threads()} threads, "
          f"fastest of {reps}")
    with kit_scheduler("kit-bench") as factory:
        for name, prompts in (("64 mixed", mixed), ("64 shared-prefix", shared)):
            t_fifo, want = run(prompts, "fifo")
            t_kit, got = run(prompts, "kit-bench")
            stats = factory.last.prefix_stats
            hit = f"{stats.hit_rate:.0%}" if stats is not None else "-"
            print(f"  {name:17s} fifo {t_fifo * 1e3:7.0f} ms  kit {t_kit * 1e3:7.0f} ms  fifo/kit "
                  f"{t_fifo / t_kit:5.2f}x  kit prefix hit rate {hit}  tokens "
                  f"{'identical' if got == want else 'DIFFER'}", flush=True)


def sampler_sweep(quick: bool, reps: int) -> None:
    """Print the sampler table (see the module docstring)."""
    from test_adapter_vllm_sampler import sampling_metadata
    from vllm.v1.sample.sampler import Sampler

    from deepinfer_kit.adapters.vllm import KitSampler

    batch, vocab, widths = 256, 151_936, [10, 100, 1_000, 10_000, 60_000]
    if quick:
        batch, vocab, widths = 8, 32_000, [10, 1_000, 20_000]
    kit, peer = KitSampler(), Sampler()
    base = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0))
    print(f"sampler: torch {torch.__version__}, {torch.get_num_threads()} threads, batch {batch} x vocab "
          f"{vocab}, top-p {bs.TOP_P}, no top-k, fastest of {reps}")
    header = f"{'temp':>4s} {'width':>6s} | {'kit ms':>8s} {'vllm ms':>8s} {'vllm/kit':>8s} | in-set"
    print(header)
    print("-" * len(header))
    ratios = []
    for temperature in bs.TEMPERATURES:
        for width in widths:
            logits = base * bs.spread_for_width(width, temperature, base[0])
            md = sampling_metadata([temperature] * batch, top_p=[bs.TOP_P] * batch)
            fns = [lambda x=logits, m=md: kit(x.clone(), m), lambda x=logits, m=md: peer(x.clone(), m)]
            (t_kit, out), (t_vllm, _) = bs.time_together(fns, reps)
            inside = bs.in_nucleus(logits, temperature, out.sampled_token_ids[:, 0].long())
            ratios.append(t_vllm / t_kit)
            print(f"{temperature:4.1f} {width:6d} | {t_kit * 1e3:8.2f} {t_vllm * 1e3:8.2f} "
                  f"{t_vllm / t_kit:7.2f}x | {'yes' if inside else 'NO'}", flush=True)
    print(f"vllm/kit: min {min(ratios):.2f}x, max {max(ratios):.2f}x over {len(ratios)} rows")


def kv_trace(num_blocks: int) -> None:
    """Time the Zipf trace through each manager (see the module docstring)."""
    import test_adapter_vllm_kv as t

    KVCacheManager, config, make = t._vllm()
    cfg = config(num_blocks)
    times = {}
    for name in ("kit", "vllm"):
        kit = t.KitKVCacheManager.from_vllm_config(cfg, 1024)
        peer = KVCacheManager(cfg, max_model_len=1024, scheduler_block_size=t.P, hash_block_size=t.P,
                              enable_caching=True)
        solo = kit if name == "kit" else peer
        free_of = (lambda m: m.num_free_blocks) if name == "kit" else (lambda m: m.block_pool.get_num_free_blocks())
        pair = _Solo(solo, free_of)
        start = time.perf_counter()
        t.drive(pair, t._zipf_trace(1000, seed=11), make)  # type: ignore[arg-type]
        times[name] = (time.perf_counter() - start, pair.hits)
    (tk, hk), (tv, hv) = times["kit"], times["vllm"]
    print(f"kv trace ({num_blocks} blocks, 1,000 requests): kit {tk * 1e3:.0f} ms, vllm {tv * 1e3:.0f} ms "
          f"(vllm/kit {tv / tk:.2f}x); hit blocks kit {hk}, vllm {hv}")


class _Solo:
    """The trace driver's interface over one manager (no comparison, for timing)."""

    def __init__(self, m: Any, free_of: Any) -> None:
        self.kit = self.peer = m
        self.m, self.free_of = m, free_of
        self.hits = self.failures = self.frees = 0

    def admit(self, req: Any) -> bool:
        blocks, n, _ = self.m.get_computed_blocks(req)
        self.hits += n // 16
        return self.m.allocate_slots(req, req.num_tokens - n, n, blocks) is not None

    def grow(self, req: Any) -> bool:
        return self.m.allocate_slots(req, 1) is not None

    def free(self, req: Any) -> None:
        self.m.free(req)

    def check(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    transformers_section(2 if args.quick else args.reps)
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        print(f"vLLM sections skipped: {exc}")
        return
    sampler_sweep(args.quick, 2 if args.quick else args.reps)
    for num_blocks in (200, 1200):
        kv_trace(num_blocks)


if __name__ == "__main__":
    main()
