"""What a round of plain decodes costs to cross to a worker process: the plan codec's
encode plus decode, host CPU time and bytes, for the scheduler's plan (decode rows as
columns) against the same batch as chunk records (``plan.as_records()``) and against a
plain ``pickle`` of the plan, measured in the same run.

    python benchmarks/bench_plan_codec.py [--sizes 64 256] [--rounds 50] [--repeats 5]

Each size runs ``N`` decoding requests (prompts of 16-128 tokens) through the continuous
scheduler; every timed round is encoded and decoded by a codec pair that confirmed the
previous rounds (the steady state: rows and tables the worker holds travel as markers).
Both codec pairs see the same plans, so the ratio is that of the two forms alone.
"""

from __future__ import annotations

import argparse
import pickle
import random
import time

from bench_scheduler import fake_step, make_request

from deepinfer_kit.cache.manager import BlockKVCacheManager
from deepinfer_kit.cache.records import CacheConfig
from deepinfer_kit.engine.remote.plan_codec import PlanDecoder, PlanEncoder
from deepinfer_kit.sched import ContinuousBatchScheduler
from deepinfer_kit.sched.records import SchedulePlan, SchedulerConfig


def _cross(encoder: PlanEncoder, decoder: PlanDecoder, plan: SchedulePlan) -> tuple[int, int]:
    """(ns, bytes) of one encode, decode and confirm."""
    t0 = time.process_time_ns()
    message, data = encoder.encode(plan)
    decoder.decode(data)
    encoder.confirm(message)
    return time.process_time_ns() - t0, len(data)


def measure(num: int, rounds: int, seed: int = 0) -> dict[str, tuple[float, float]]:
    """Best-round (µs, bytes) per form over ``rounds`` rounds of ``num`` decodes."""
    rng = random.Random(seed)
    config = SchedulerConfig(max_num_seqs=num, max_num_batched_tokens=2 * num, max_model_len=1 << 16)
    cache = BlockKVCacheManager.create(CacheConfig(block_size=16, num_blocks=num * 64), index="hash")
    sched = ContinuousBatchScheduler(config, cache)
    for i in range(num):
        sched.add(make_request(rng, i, (16, 128), (rounds + 400, rounds + 400)))
    codecs = {"columns": (PlanEncoder(), PlanDecoder()), "records": (PlanEncoder(), PlanDecoder())}
    best = {name: (float("inf"), 0.0) for name in (*codecs, "pickle")}
    for i in range(rounds + 150):
        plan = sched.schedule()
        timed = i >= 150 and len(plan.decodes) == num  # every request decoding
        for name, (encoder, decoder) in codecs.items():
            ns, size = _cross(encoder, decoder, plan if name == "columns" else plan.as_records())
            if timed and ns / 1000 < best[name][0]:
                best[name] = (ns / 1000, float(size))
        if timed:
            t0 = time.process_time_ns()
            data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
            pickle.loads(data)
            us = (time.process_time_ns() - t0) / 1000
            if us < best["pickle"][0]:
                best["pickle"] = (us, float(len(data)))
        sched.commit(plan, fake_step(plan))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    args = parser.parse_args()
    print("encode + decode of one round of N plain decodes (host CPU time, best round)")
    print(f"{'N':>5} {'columns us':>11} {'records us':>11} {'pickle us':>10} {'records/columns':>16} "
          f"{'columns B':>10} {'records B':>10}")
    for num in args.sizes:
        runs = [measure(num, args.rounds, seed) for seed in range(args.repeats)]
        col = min(r["columns"] for r in runs)
        rec = min(r["records"] for r in runs)
        raw = min(r["pickle"] for r in runs)
        print(f"{num:>5} {col[0]:>11.0f} {rec[0]:>11.0f} {raw[0]:>10.0f} {rec[0] / col[0]:>15.2f}x "
              f"{col[1]:>10.0f} {rec[1]:>10.0f}")


if __name__ == "__main__":
    main()
