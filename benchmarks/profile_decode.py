"""Where a decode step's time goes: the engine's batch-B decode under the torch profiler.

Builds the same random Qwen3-shaped checkpoint as ``bench_decode.py`` (the 1.7B shape on
CUDA, the small one on CPU), runs B requests to a steady decode, then profiles
``--steps`` engine steps and prints, per step:

* wall ms (host clock around ``engine.step()``, synchronised on CUDA);
* device busy ms: the union of the kernels' intervals on the device timeline, and the
  idle gap (wall - busy), which is host time the device waited for;
* the kernels by total device time (calls per step, ms per step, share of busy time);
* the weight-read roofline (weights / copy bandwidth measured in the same run), so each
  kernel's share can be read against what the step must cost.

Run with and without CUDA graphs to see the launch overhead a graph removes:

    PYTHONPATH=src python benchmarks/profile_decode.py --device cuda --batch 1
    PYTHONPATH=src python benchmarks/profile_decode.py --device cuda --batch 1 --no-cuda-graphs
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from bench_decode import FULL_SHAPE, SMALL_SHAPE, build_checkpoint, copy_bandwidth, weight_bytes


def _busy_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start_us, end_us)`` intervals, in ms."""
    total = 0.0
    end = float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1e3


def _kernel_events(prof: Any) -> list[Any]:
    """The profiler's device-side kernel events (CUDA kernels, or CPU ops on a CPU run)."""
    from torch.autograd import DeviceType

    events = list(prof.events())
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    return kernels or [e for e in events if e.device_type == DeviceType.CPU and not e.cpu_parent]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=16, help="decode steps profiled")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--small", action="store_true")
    args = parser.parse_args()
    from deepinfer_kit import SamplingParams, build_engine

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    shape = SMALL_SHAPE if (args.small or not cuda) else FULL_SHAPE
    dtype = torch.bfloat16 if cuda else torch.float32
    vocab = shape[-1]
    rng = random.Random(0)
    prompts = [[rng.randrange(1, vocab - 1) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    bandwidth = copy_bandwidth(device, 1024 if cuda else 256)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        build_checkpoint(path, shape, dtype, device, 0)
        max_len = args.prompt_len + 3 * args.steps + 8
        engine = build_engine(model=str(path), dtype=str(dtype).removeprefix("torch."), device=args.device,
                              max_num_seqs=args.batch, max_model_len=max_len,
                              enable_prefix_caching=False,
                              **({"cuda_graphs": False} if args.no_cuda_graphs else {}))
    wbytes = weight_bytes(engine.runner.model)
    params = SamplingParams(temperature=0.0, max_tokens=3 * args.steps, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    for _ in range(args.steps):  # prefill and a steady decode (graphs captured, kernels compiled)
        engine.step()
    sync()
    walls: list[float] = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.step()
            sync()
            walls.append(time.perf_counter() - t0)
    while engine.has_unfinished_requests():
        engine.step()
    engine.flush()
    kernels = _kernel_events(prof)
    busy = _busy_ms([(e.time_range.start, e.time_range.end) for e in kernels]) / args.steps
    wall = sum(walls) / len(walls) * 1e3
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        by_name[e.name].append((e.time_range.end - e.time_range.start) / 1e3)
    roof = wbytes / bandwidth * 1e3
    print(f"shape {shape}, {dtype}, batch {args.batch}, cuda graphs "
          f"{'off' if args.no_cuda_graphs else 'as configured'}, {args.steps} steps profiled")
    print(f"weights {wbytes / 1e6:.0f} MB; copy bandwidth {bandwidth / 1e9:.0f} GB/s; "
          f"weight-read roofline {roof:.3f} ms/step")
    print(f"wall {wall:.3f} ms/step (median {sorted(walls)[len(walls) // 2] * 1e3:.3f}); device busy "
          f"{busy:.3f} ms/step ({busy / wall:.0%} of wall); idle gap {wall - busy:.3f} ms; "
          f"roofline/wall {roof / wall:.0%}, roofline/busy {roof / busy:.0%}")
    print(f"{'kernel':70} {'calls/step':>10} {'ms/step':>8} {'of busy':>8}")
    rows = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    for name, times in rows[:args.top]:
        ms = sum(times) / args.steps
        print(f"{name[:70]:70} {len(times) / args.steps:10.1f} {ms:8.3f} {ms / busy:8.1%}")
    print(f"kernels per step: {len(kernels) / args.steps:.0f} ({len(by_name)} distinct)")


if __name__ == "__main__":
    main()
