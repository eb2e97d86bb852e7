"""KV tiers in the simulator: a multi-turn chat workload whose working set is 4x the device
pool, served by the real scheduler, cache manager and tiers' scheduler side on a virtual
clock (Qwen3-1.7B on an H200, analytic cost; the tiers' device <-> host copies priced at
the GPU's host bandwidth) — device only vs + host vs + host + disk; ``--model
llama3-70b-tp4`` for a 70B model on a TP-4 instance, where a token's prefill costs far more
than copying its KV.

    .venv/bin/python benchmarks/bench_sim_tiers.py [--quick] [--model llama3-70b-tp4]

Prints the working set, then per config: prefix hit rate, prefill tokens computed and
saved against device only, the tiers' counters, TTFT p50/p90 and output throughput (ratios
against the device-only run of the same invocation). Disk reads are modelled as landing
before admission (prefetched from arrival) and cost nothing in the round; host copies are
priced serially before each round's forward.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from deepinfer_kit.cache.tiers.manager import TieredKVCacheManager  # noqa: E402
from deepinfer_kit.engine.config import EngineConfig  # noqa: E402
from deepinfer_kit.sim.build import build_simulator  # noqa: E402
from deepinfer_kit.sim.cost_analytic import H200, QWEN3_1_7B, AnalyticCost, ModelShape  # noqa: E402
from deepinfer_kit.sim.cost_tp import LLAMA3_70B, TensorParallel, TensorParallelCost  # noqa: E402
from deepinfer_kit.sim.protocols import CostModel  # noqa: E402
from deepinfer_kit.sim.lengths import LengthDist  # noqa: E402
from deepinfer_kit.sim.workload import WorkloadConfig, generate  # noqa: E402

P = 16


def workload(quick: bool) -> WorkloadConfig:
    """Conversations of 8 turns, interleaved by Poisson first turns and short think times."""
    return WorkloadConfig(
        num_requests=400 if quick else 2400, seed=1, rate=40.0, multi_turn_fraction=1.0, turns=8,
        think_time=0.5, prompt_len=LengthDist("lognormal", 800.0, 0.5),
        output_len=LengthDist("lognormal", 150.0, 0.5), followup_len=LengthDist("lognormal", 120.0, 0.5),
        shared_fraction=0.5, shared_prefix_len=512, num_shared_prefixes=4,
    )


MODELS: dict[str, tuple[ModelShape, CostModel]] = {
    "qwen3-1.7b": (QWEN3_1_7B, AnalyticCost(QWEN3_1_7B, H200)),
    "llama3-70b-tp4": (LLAMA3_70B, TensorParallelCost(LLAMA3_70B, H200, TensorParallel(4))),
}


def run(num_blocks: int, tiers: dict[str, object] | None, quick: bool, model: str) -> tuple[object, object, int, int]:
    """One simulation; returns its report, the tiers' counters, prompt tokens and the
    device cache's published blocks at the end."""
    config = EngineConfig(num_blocks=num_blocks, block_size=P, max_num_seqs=64,
                          max_model_len=16384, kv_tiers=tiers)
    shape, cost = MODELS[model]
    sim = build_simulator(config, cost, shape)
    report = sim.run(generate(workload(quick)))
    cache = sim.cache
    stats = cache.tier_stats if isinstance(cache, TieredKVCacheManager) else None
    published = cache.stats.inserted_blocks if cache.stats is not None else 0
    return report, stats, report.prompt_tokens, published


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="400 requests instead of 2400")
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-1.7b")
    args = parser.parse_args()
    print(f"model {args.model}")
    _, _, _, working_set = run(1 << 20, None, args.quick, args.model)  # a pool that never evicts: every distinct block
    pool = max(working_set // 4, 1100)
    print(f"working set {working_set} distinct prefix blocks of {P} tokens; device pool {pool} blocks "
          f"({working_set / pool:.1f}x); host tier {2 * pool}; disk tier {2 * working_set}")
    configs = [
        ("device only", None),
        ("+host", {"host_blocks": 2 * pool}),
        ("+host+disk", {"host_blocks": 2 * pool, "disk_blocks": 2 * working_set, "disk_path": "unused"}),
        ("+host+disk write_back", {"host_blocks": 2 * pool, "disk_blocks": 2 * working_set,
                                   "disk_path": "unused", "write_policy": "write_back"}),
    ]
    print(f"{'config':24}{'hit rate':>9}{'prefill':>10}{'saved':>8}{'host_hits':>10}{'disk_hits':>10}"
          f"{'saved_h':>9}{'saved_d':>9}{'ttft p50':>10}{'ttft p90':>10}{'out tok/s':>11}{'x dev':>7}")
    base_tps = base_prefill = 0.0
    for name, tiers in configs:
        report, stats, prompt, _ = run(pool, tiers, args.quick, args.model)
        hit = report.prefix_hit_rate  # type: ignore[attr-defined]
        prefill = prompt * (1 - hit)
        tps = report.output_throughput  # type: ignore[attr-defined]
        if tiers is None:
            base_tps, base_prefill = tps, prefill
        cells = ([stats.host_hits, stats.disk_hits, stats.saved_host, stats.saved_disk]  # type: ignore[attr-defined]
                 if stats is not None else ["-"] * 4)
        print(f"{name:24}{hit:>9.1%}{prefill:>10.0f}{1 - prefill / base_prefill:>8.1%}"
              + "".join(f"{c:>10}" if i < 2 else f"{c:>9}" for i, c in enumerate(cells))
              + f"{report.ttft.p50 * 1e3:>9.0f}ms{report.ttft.p90 * 1e3:>8.0f}ms{tps:>11.0f}"  # type: ignore[attr-defined]
              f"{tps / base_tps:>7.2f}")
    print("(hit rate: prompt tokens from any cache / prompt tokens; prefill: prompt tokens computed; "
          f"host copies priced at {H200.host_bandwidth / 1e9:.0f} GB/s)")


if __name__ == "__main__":
    main()
