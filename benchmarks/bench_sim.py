"""Simulation speed: requests simulated per wall second, the real scheduler and KV cache
manager included (target: 100,000 requests in <= 45 s on a 2-core machine).

Workload: mean 500 prompt / 200 output tokens (lognormal), 30% opening with a shared
256-token system prompt, Poisson arrivals; Qwen3-1.7B on an H200 (analytic cost),
40 GiB of KV, the default EngineConfig scheduler (continuous, FCFS, budget 2048, 128 seqs).
Two baselines in the same run, both on the same workload's first 5%: the simulator
round by round (``Simulator(stretches=False)``: a plan per round, no stretch of
plain-decode rounds applied at once) — the ratio is what stretches buy, and the two
reports must be equal — and the per-request cost of that 5% against the whole run's,
which shows whether the cost per request stays flat as the run grows. ``--rate 20``
is the ``deepinfer-kit sim`` default workload's rate.

    .venv/bin/python benchmarks/bench_sim.py                  # 100,000 requests
    .venv/bin/python benchmarks/bench_sim.py -n 5000          # a smoke run
    .venv/bin/python benchmarks/bench_sim.py --profile        # cProfile, top 20 by own time

On a shared machine compare the process CPU time of the simulate phase ("CPU ..."), of
the old and new code run alternately (``PYTHONPATH=<checkout>/src``), not wall times.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from typing import Any

import attrs

from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.sim import (
    H200, QWEN3_1_7B, AnalyticCost, LengthDist, WorkloadConfig, build_simulator, generate,
)


def run(n: int, rate: float, profile: bool, stretches: bool = True) -> tuple[float, dict[str, Any]]:
    """Generate and simulate ``n`` requests; returns (wall seconds, the report without its
    wall time)."""
    t0 = time.perf_counter()
    reqs = generate(WorkloadConfig(
        num_requests=n, seed=0, rate=rate,
        prompt_len=LengthDist("lognormal", 500, 0.6, 8, 8000),
        output_len=LengthDist("lognormal", 200, 0.6, 1, 4000),
        shared_fraction=0.3, shared_prefix_len=256,
    ))
    gen_s = time.perf_counter() - t0
    sim = build_simulator(EngineConfig(kv_cache_memory_mb=40 * 1024, max_model_len=16384),
                          AnalyticCost(QWEN3_1_7B, H200), QWEN3_1_7B)
    sim.stretches = stretches
    prof = cProfile.Profile() if profile else None
    t1, c1 = time.perf_counter(), time.process_time()
    if prof is not None:
        prof.enable()
    report = sim.run(reqs)
    if prof is not None:
        prof.disable()
    wall = time.perf_counter() - t1
    cpu = time.process_time() - c1
    mode = "stretches" if stretches else "round by round"
    print(f"n={n} ({mode}): generate {gen_s:.2f}s, simulate {wall:.2f}s (CPU {cpu:.2f}s) = "
          f"{n / wall:,.0f} requests/s "
          f"({report.num_steps:,} rounds, {report.output_tokens:,} output tokens, "
          f"{report.output_tokens / wall:,.0f} tokens/s simulated); virtual "
          f"{report.duration_s:.1f}s, {report.output_throughput:,.0f} out tok/s, "
          f"prefix hits {report.prefix_hit_rate:.1%}, preemptions {report.preemptions}")
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    summary = attrs.asdict(report)
    summary.pop("wall_s")
    return wall + gen_s, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=100_000)
    ap.add_argument("--rate", type=float, default=100.0, help="arrivals per virtual second")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    small = max(args.n // 20, 1)
    plain, plain_report = run(small, args.rate, False, stretches=False)
    base, base_report = run(small, args.rate, False)
    print(f"n={small}: stretches vs round by round {plain / base:.2f}x faster, reports "
          f"{'equal' if base_report == plain_report else 'DIFFERENT'}")
    total, _ = run(args.n, args.rate, args.profile)
    print(f"wall {total:.1f}s for {args.n:,} requests (target <= 45 s): "
          f"{'met' if total <= 45 else 'MISSED'}; per-request cost vs the 5% baseline: "
          f"{(total / args.n) / (base / small):.2f}x")

if __name__ == "__main__":
    main()
