"""How much host time the overlapped engine hides: (b) a runner whose device part takes a
fixed time while the host's work per step is H, swept over H/T; (a) the embedded model on a
serving workload (and, with --bench-engine, bench_engine.py's workload).

Engines, same requests, same process, tokens compared with the synchronous engine's:

* ``sync``: the synchronous engine, model in this process (the baseline);
* ``thread``: overlapped, the step on a worker thread of this process (one GIL);
* ``process``: overlapped, the model in a worker process (``worker="process"``);
* in (a) also ``process sync``: the worker process, not overlapped (what the process
  boundary costs).

(b): each execute does the tiny model's real work for the plan, then sleeps T (GIL
released, like a device); the host's work H is a busy loop added to every ``schedule()``.
From the synchronous run: D = time inside execute per step, Hs = the rest of the step (H
plus the engine's own host work). An overlapped step ideally takes max(Hs, D); "hidden" is
the share of min(Hs, D) the overlapped step no longer pays over the synchronous one, and
the target is a step of at most max(Hs, D) + 0.1 * min(Hs, D) (>= 90% hidden).

    .venv/bin/python benchmarks/bench_overlap.py                 # (b) T = 20 ms, H/T 0.2 .. 2; (a)
    .venv/bin/python benchmarks/bench_overlap.py --bench-engine  # also bench_engine's workload
    .venv/bin/python benchmarks/bench_overlap.py --quick         # a smoke run
    .venv/bin/python benchmarks/bench_overlap.py --device cuda   # the same on a GPU
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from deepinfer_kit import Engine, SamplingParams, build_engine
from overlap_hooks import FixedDeviceTime

ENGINES = {"sync": {"overlap": False}, "thread": {"overlap": True},
           "process": {"overlap": True, "worker": "process"}}


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def serve(engine: Engine, requests: list[tuple[str, Any, SamplingParams]]) -> tuple[float, int, list[Any]]:
    """(seconds, steps, outputs) of serving ``requests`` to the end on ``engine``."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    steps, outs = 0, []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
        steps += 1
    outs.extend(engine.flush())
    elapsed = time.perf_counter() - start
    engine.check_idle()
    return elapsed, steps, sorted((o.request_id, [c.token_ids for c in o.outputs]) for o in outs)


def fixed_device(kind: str, host_s: float, device_s: float, num: int, new: int,
                 device: str) -> tuple[float, float, list[Any]]:
    """(ms per step, ms inside execute per step — measured only in this process, outputs)."""
    hook = FixedDeviceTime(device_s)
    engine = build_engine(num_blocks=256, block_size=16, max_model_len=256, max_num_seqs=num,
                          device=device, worker_setup=hook, **ENGINES[kind])  # type: ignore[arg-type]
    inner_schedule = engine.scheduler.schedule

    def schedule() -> Any:
        _busy(host_s)
        return inner_schedule()

    engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    seconds, steps, outs = serve(engine, [(f"r{i}", [1 + i, 2, 3, 4], params) for i in range(num)])
    engine.close()
    return seconds / steps * 1e3, hook.busy / max(hook.steps, 1) * 1e3, outs


def sweep(args: argparse.Namespace) -> None:
    T = args.device_ms / 1000
    print(f"(b) fixed device time: T = {args.device_ms:.1f} ms slept per step after the real work, "
          f"{args.requests} requests x {args.new_tokens} tokens, device {args.device}, torch threads "
          f"{torch.get_num_threads()}")
    print(f"{'H/T':>5} {'D ms':>6} {'Hs ms':>6} {'sync':>7} {'thread':>7} {'hidden':>7} "
          f"{'process':>8} {'hidden':>7} {'bound':>7} {'met':>4} {'same tokens':>12}")
    for ratio in args.ratios:
        H = ratio * T
        sync_ms, device_ms, want = fixed_device("sync", H, T, args.requests, args.new_tokens, args.device)
        thread_ms, _, thread_out = fixed_device("thread", H, T, args.requests, args.new_tokens, args.device)
        proc_ms, _, proc_out = fixed_device("process", H, T, args.requests, args.new_tokens, args.device)
        host_ms = sync_ms - device_ms
        small, large = min(host_ms, device_ms), max(host_ms, device_ms)
        bound = large + 0.1 * small
        print(f"{ratio:5.2f} {device_ms:6.2f} {host_ms:6.2f} {sync_ms:7.2f} {thread_ms:7.2f} "
              f"{(sync_ms - thread_ms) / small:7.0%} {proc_ms:8.2f} {(sync_ms - proc_ms) / small:7.0%} "
              f"{bound:7.2f} {'yes' if proc_ms <= bound else 'no':>4} "
              f"{str(want == thread_out == proc_out):>12}")


def engine_workload(title: str, model: str, requests: list[tuple[str, Any, SamplingParams]],
                    reps: int, **config: Any) -> None:
    """Steps/s and output tokens/s of each engine on ``requests``: the engines take turns
    within each rep (the order rotating), and each engine's ratio to the synchronous one
    is the median over reps of the ratio within a rep (this machine's speed drifts by tens
    of percent from one run to the next; pairs measured seconds apart share the drift)."""
    kinds = {**ENGINES, "process sync": {"overlap": False, "worker": "process"}}
    engines = {k: build_engine(model=model, **v, **config) for k, v in kinds.items()}
    names = list(engines)
    times: dict[str, list[float]] = {k: [] for k in names}
    steps: dict[str, int] = {}
    outs: dict[str, list[Any]] = {}
    for rep in range(reps):
        for kind in names[rep % len(names):] + names[: rep % len(names)]:
            seconds, steps[kind], outs[kind] = serve(engines[kind], requests)
            times[kind].append(seconds)
    tokens = sum(len(t) for _, comps in outs["sync"] for t in comps)
    print(f"(a) {title}: {len(requests)} requests, {tokens} output tokens, torch threads "
          f"{torch.get_num_threads()}, {reps} reps")
    print(f"{'engine':>13} {'median s':>9} {'best s':>7} {'steps/s':>8} {'out tok/s':>10} "
          f"{'vs sync':>8} {'same tokens':>12}")
    for kind in names:
        med = statistics.median(times[kind])
        ratio = statistics.median(a / b for a, b in zip(times["sync"], times[kind]))
        print(f"{kind:>13} {med:9.3f} {min(times[kind]):7.3f} {steps[kind] / med:8.1f} "
              f"{tokens / med:10.1f} {ratio:7.3f}x {str(outs[kind] == outs['sync']):>12}")
    for engine in engines.values():
        engine.close()


def embedded(args: argparse.Namespace) -> None:
    prompts = ["The paged KV cache stores each request's keys and values in fixed-size blocks.",
               "Continuous batching admits new requests every round.",
               "A mixture-of-experts layer routes every token to a few experts.",
               "Speculative decoding drafts tokens that the target model then verifies."]
    params = SamplingParams(temperature=0.0, max_tokens=args.words_tokens)
    requests = [(f"w{i}", f"{prompts[i % 4]} ({i})", params) for i in range(args.words_requests)]
    engine_workload("tiny-words", "tiny-words", requests, args.reps, num_blocks=1024,
                    max_model_len=512, max_num_seqs=64, device=args.device)


def bench_engine_workload(args: argparse.Namespace) -> None:
    import bench_engine

    ns = argparse.Namespace(num_requests=64, min_prompt=16, max_prompt=256, min_new=16, max_new=128,
                            vocab=32000, hidden=512, layers=4, experts=16, top_k=4,
                            moe_intermediate=256, seed=0)
    reqs = bench_engine.make_requests(ns)
    requests = [(f"b{i}", p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
                for i, (p, n) in enumerate(reqs)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        bench_engine.build_checkpoint(path, ns)
        engine_workload("bench_engine's workload (small Qwen3-MoE)", str(path), requests,
                        args.engine_reps, max_num_seqs=64, max_num_batched_tokens=2048,
                        kv_cache_memory_mb=1024, device=args.device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device-ms", type=float, default=20.0, help="T per step")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.2, 0.5, 0.8, 1.0, 1.25, 2.0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=30)
    parser.add_argument("--words-requests", type=int, default=16)
    parser.add_argument("--words-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the worker's too)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (every engine runs there)")
    parser.add_argument("--bench-engine", action="store_true", help="also bench_engine.py's workload")
    parser.add_argument("--engine-reps", type=int, default=6)
    parser.add_argument("--skip-sweep", action="store_true")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.device_ms, args.ratios, args.new_tokens = 5.0, [0.5, 2.0], 8
        args.words_requests, args.words_tokens, args.reps = 4, 8, 2
    torch.set_num_threads(args.threads)
    if not args.skip_sweep:
        sweep(args)
    embedded(args)
    if args.bench_engine:
        bench_engine_workload(args)


if __name__ == "__main__":
    main()
