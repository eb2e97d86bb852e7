"""How much host time the overlapped engine hides: a runner whose device part takes a
fixed time T and a host whose work per step takes H, swept over H/T.

The runner's ``execute`` sleeps T (the GIL is released, as in a real forward) after
doing the embedded model's real work for the plan; the host work H is a busy loop added
to every ``schedule()``. Synchronous steps take about H + T; overlapped ones
max(H, T) — the fraction of the smaller one hidden is printed per H/T, with the same
workload, in the same process. The outputs of both engines are compared token for token.

    .venv/bin/python benchmarks/bench_overlap.py            # T = 20 ms, H/T 0.2 .. 2
    .venv/bin/python benchmarks/bench_overlap.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from deepinfer_kit import SamplingParams, build_engine


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def run(overlap: bool, host_s: float, device_s: float, num: int, new: int) -> tuple[float, int, list[Any]]:
    """(seconds, steps, outputs) of ``num`` greedy requests of ``new`` tokens."""
    engine = build_engine(overlap=overlap, num_blocks=256, block_size=16, max_model_len=256,
                          max_num_seqs=num)
    inner_execute, inner_schedule = engine.runner.execute, engine.scheduler.schedule

    def execute(step: Any) -> Any:
        result = inner_execute(step)
        time.sleep(device_s)
        return result

    def schedule() -> Any:
        _busy(host_s)
        return inner_schedule()

    engine.runner.execute = execute  # type: ignore[method-assign]
    engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    for i in range(num):
        engine.add_request(f"r{i}", [1 + i, 2, 3, 4], params)
    steps = 0
    start = time.perf_counter()
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
        steps += 1
    outs.extend(engine.flush())
    elapsed = time.perf_counter() - start
    engine.check_idle()
    return elapsed, steps, sorted((o.request_id, o.outputs[0].token_ids) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device-ms", type=float, default=20.0, help="T per step")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.2, 0.5, 0.8, 1.0, 1.25, 2.0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=30)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.device_ms, args.ratios, args.new_tokens = 5.0, [0.5, 2.0], 8
    torch.set_num_threads(1)
    T = args.device_ms / 1000
    print(f"T = {args.device_ms:.1f} ms per step, {args.requests} requests x {args.new_tokens} tokens")
    print(f"{'H/T':>5} {'sync ms/step':>13} {'overlap ms/step':>16} {'ideal':>7} "
          f"{'hidden':>7} {'speedup':>8} {'same tokens':>12}")
    for ratio in args.ratios:
        H = ratio * T
        sync_s, sync_steps, sync_out = run(False, H, T, args.requests, args.new_tokens)
        over_s, over_steps, over_out = run(True, H, T, args.requests, args.new_tokens)
        sync_ms = sync_s / sync_steps * 1e3
        over_ms = over_s / over_steps * 1e3
        hidden = min(H, T) * 1e3
        # the share of the smaller of H and T that the overlapped step no longer pays
        frac = (sync_ms - over_ms) / hidden if hidden else 0.0
        print(f"{ratio:5.2f} {sync_ms:13.2f} {over_ms:16.2f} {max(H, T) * 1e3:7.2f} "
              f"{frac:7.0%} {sync_ms / over_ms:7.2f}x {str(sync_out == over_out):>12}")


if __name__ == "__main__":
    main()
