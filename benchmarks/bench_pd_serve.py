"""Prefill/decode servers behind the proxy against one server, on the tiny model (CPU): what
the split costs a request — the extra hop, and the KV's way between the servers: the prefill
server's file writes and the decode server's reads through a shared folder, or a device
link (``--kv-link``) — measured as time to first token and end-to-end latency, streamed.

Every setup runs as real commands (``deepinfer-kit serve`` processes; the pairs with
``--kv-role prefill|decode`` over one KV folder in /dev/shm when it exists, or over
``--kv-link``, and ``deepinfer-kit pd-proxy`` in front), with the same pool, one after the
other. Requests are
token-id prompts (``--prompt-tokens``, no two sharing a block) with ``--max-tokens``
outputs, greedy, sent ``--concurrency`` at a time; the first ``--warmup`` are not counted.
Every answer is checked against the single server's: the tokens must be the same. No
timing is asserted; the times are this machine's (on a 2-core machine the three processes
of the pair share the cores the single server has to itself, so the ratio bounds the
cost of the split from above).

    .venv/bin/python benchmarks/bench_pd_serve.py [--requests 48] [--concurrency 1 4]
        [--prompt-tokens 512] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

SRC = Path(__file__).resolve().parents[1] / "src"
KINDS = ("one server", "pair, folder", "pair, link")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(*args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.Popen([sys.executable, "-m", "deepinfer_kit.cli", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def wait_up(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} did not come up")


async def one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> tuple[float, float, str]:
    """(time to first text, latency, text) of one streamed completion."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    t0 = time.perf_counter()
    first, text = 0.0, ""
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            piece = "".join(c.get("text", "") for c in json.loads(line[6:]).get("choices", []))
            if piece and not first:
                first = time.perf_counter() - t0
            text += piece
    return first, time.perf_counter() - t0, text


async def load(url: str, prompts: list[list[int]], args: argparse.Namespace, concurrency: int) -> list[tuple[float, float, str]]:
    out: list[tuple[float, float, str]] = [(0.0, 0.0, "")] * len(prompts)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300) as client:
        async def run(i: int) -> None:
            async with gate:
                out[i] = await one(client, url, prompts[i], args.max_tokens)
        await asyncio.gather(*(run(i) for i in range(len(prompts))))
    return out


def setup(kind: str, pool: list[str], folder: str) -> tuple[str, list[subprocess.Popen[bytes]]]:
    if kind == "one server":
        port = free_port()
        proc = start("serve", "--port", str(port), *pool)
        wait_up(f"http://127.0.0.1:{port}", proc)
        return f"http://127.0.0.1:{port}", [proc]
    ports = [free_port() for _ in range(4)]
    urls = [f"http://127.0.0.1:{p}" for p in ports[:3]]
    if kind == "pair, link":  # the KV over a device link (gloo here; NCCL between GPUs)
        kv = ["--kv-link", f"127.0.0.1:{ports[3]}"]
    else:
        kv = ["--kv-tiers", json.dumps({"host_blocks": 512, "disk_blocks": 16384, "disk_path": folder,
                                        "hash_key": secrets.token_hex(32), "prefetch_timeout_s": 2.0})]
    procs = [start("serve", "--port", str(ports[0]), "--kv-role", "prefill", *kv, *pool),
             start("serve", "--port", str(ports[1]), "--kv-role", "decode", *kv, *pool)]
    for p, u in zip(procs, urls):
        wait_up(u, p)
    procs.append(start("pd-proxy", "--port", str(ports[2]), "--prefill", urls[0], "--decode", urls[1]))
    wait_up(urls[2], procs[2])
    return urls[2], procs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    P = 16
    pool = ["--model", "tiny", "--num-blocks", "2048", "--block-size", str(P), "--max-model-len", "1024",
            "--max-num-seqs", "16", "--threads", "1"]
    n = args.warmup + args.requests
    print(f"{args.requests} requests (+{args.warmup} warm-up) of {args.prompt_tokens} prompt tokens, "
          f"{args.max_tokens} output tokens, greedy, streamed; block size {P}")
    results: dict[tuple[str, int], list[tuple[float, float, str]]] = {}
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    for kind in KINDS:
        with tempfile.TemporaryDirectory(prefix="bench_pd_", dir=shm) as folder:
            url, procs = setup(kind, pool, folder)
            try:
                for c in args.concurrency:
                    # fresh prompts per run (a run never hits the last one's prefixes), the same across setups
                    prompts = [[(7919 * (c * 1000 + i) + 31 * j) % 250 + 1 for j in range(args.prompt_tokens)]
                               for i in range(n)]
                    results[(kind, c)] = asyncio.run(load(url, prompts, args, c))[args.warmup:]
            finally:
                for p in procs:
                    p.terminate()
                    p.wait(30)
    head = f"{'setup':<16}{'conc':>5}{'ttft p50 ms':>12}{'ttft p90 ms':>12}{'lat p50 ms':>11}{'lat p90 ms':>11}{'x ttft':>8}{'x lat':>7}  same tokens"
    print(head)
    print("-" * len(head))
    for c in args.concurrency:
        base = results[("one server", c)]
        b_ttft = statistics.median(r[0] for r in base)
        b_lat = statistics.median(r[1] for r in base)
        for kind in KINDS:
            rs = results[(kind, c)]
            ttft = sorted(r[0] * 1e3 for r in rs)
            lat = sorted(r[1] * 1e3 for r in rs)
            same = [r[2] for r in rs] == [r[2] for r in base]
            p90 = max(0, int(0.9 * len(rs)) - 1)
            print(f"{kind:<16}{c:>5}{statistics.median(ttft):>12.1f}{ttft[p90]:>12.1f}{statistics.median(lat):>11.1f}"
                  f"{lat[p90]:>11.1f}{statistics.median(ttft) / 1e3 / b_ttft:>8.2f}"
                  f"{statistics.median(lat) / 1e3 / b_lat:>7.2f}  {same}")
    print("(x ttft, x lat: the median against one server's at the same concurrency)")


if __name__ == "__main__":
    main()
