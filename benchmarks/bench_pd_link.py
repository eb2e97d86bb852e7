"""Prefill/decode pairs in one process, by how the KV moves: a shared folder (the disk tier
of both engines in ``/dev/shm``: each prompt block copied to the prefill engine's host
slab, written as a checksummed file, read back into the decode engine's host slab, then
copied to its pool) against the device link (each prompt block gathered into a send slot
on the prefill engine's device, copied into the decode engine's landing slots, then
scattered into its pool: no host slab, no file). One engine serving every request is the
baseline of both; all three in the same run, same requests, greedy on the tiny model.

Columns: wall time for the requests (and its ratio to one engine and to the folder pair),
the time the pair spends handing requests over (``push_kv_down``: the prefill engine's
queued copies run and, for the folder, the files written) per request, the prompt blocks
each decode engine loaded instead of computing, and whether the tokens equal one engine's.

Torch runs one intra-op thread (``--threads``), as the other engine benchmarks do on a
2-core machine; a short warm-up precedes the measured runs.

    .venv/bin/python benchmarks/bench_pd_link.py [--requests N] [--prompt T] [--threads N] [--quick]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from deepinfer_kit.disagg import engine as disagg_engine
from deepinfer_kit.disagg import build_device_disaggregated
from deepinfer_kit.disagg.engine import DisaggregatedEngine, build_disaggregated
from deepinfer_kit.engine.build import build_engine
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.sample.params import SamplingParams


def _requests(n: int, prompt: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(250) for _ in range(prompt)] for _ in range(n)]


def _one_engine(cfg: EngineConfig, prompts: list[list[int]], out: int) -> tuple[float, dict[str, list[int]]]:
    engine = build_engine(cfg)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=out, temperature=0.0))
    got = {o.request_id: list(o.outputs[0].token_ids) for o in engine.run()}
    wall = time.perf_counter() - t0
    engine.close()
    return wall, got


def _pair(make: Callable[[], DisaggregatedEngine], prompts: list[list[int]], out: int, block: int) -> dict[str, Any]:
    pair = make()
    handoff = [0.0]
    real = disagg_engine.push_kv_down

    def timed(engine: Any) -> Any:
        t = time.perf_counter()
        try:
            return real(engine)
        finally:
            handoff[0] += time.perf_counter() - t

    disagg_engine.push_kv_down = timed  # type: ignore[assignment]
    try:
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            pair.add_request(str(i), p, SamplingParams(max_tokens=out, temperature=0.0))
        outputs = pair.run()
        wall = time.perf_counter() - t0
    finally:
        disagg_engine.push_kv_down = real
    loaded = sum(o.num_cached_tokens for o in outputs) // block
    got = {o.request_id: list(o.outputs[0].token_ids) for o in outputs}
    pair.prefill.check_idle()
    pair.decode.check_idle()
    pair.close()
    return {"wall": wall, "handoff": handoff[0] / len(prompts), "loaded": loaded, "tokens": got}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--output", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = 6 if args.quick else args.requests
    cfg = EngineConfig(block_size=16, num_blocks=1024, max_num_seqs=4, max_model_len=1024)
    prompts = _requests(n, args.prompt, args.seed)
    usable = sum((len(p) - 1) // cfg.block_size for p in prompts)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        makers: dict[str, Callable[[], DisaggregatedEngine]] = {
            "folder (/dev/shm)": lambda: build_disaggregated(cfg, shm, host_blocks=256, disk_blocks=8192),
            "device link": lambda: build_device_disaggregated(cfg, send_slots=256, landing_slots=1024),
        }
        for make in makers.values():  # warm-up
            _pair(make, prompts[:2], 2, cfg.block_size)
        base_wall, reference = _one_engine(cfg, prompts, args.output)
        rows = {name: _pair(make, prompts, args.output, cfg.block_size) for name, make in makers.items()}
    folder = rows["folder (/dev/shm)"]
    print(f"{n} requests of {args.prompt} prompt tokens, {args.output} out; {usable} usable prompt blocks; "
          f"one engine {base_wall * 1e3:.0f} ms")
    print(f"{'pair':<20}{'wall ms':>9}{'x one':>7}{'x folder':>9}{'handoff ms/req':>16}{'loaded':>8}  tokens")
    for name, r in rows.items():
        same = "same" if r["tokens"] == reference else "DIFFER"
        print(f"{name:<20}{r['wall'] * 1e3:>9.0f}{r['wall'] / base_wall:>7.2f}{r['wall'] / folder['wall']:>9.2f}"
              f"{r['handoff'] * 1e3:>16.2f}{r['loaded']:>8}  {same}")
    print(f"handoff, device link / folder: {rows['device link']['handoff'] / folder['handoff']:.2f}x")


if __name__ == "__main__":
    main()
