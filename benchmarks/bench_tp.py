"""Tensor parallelism on CPU (gloo): step time at T = 1, 2, 4, the communication share of a
step, and each rank's resident weight bytes against 1/T of the dense model plus the parts
every rank keeps whole.

Each T runs T processes (one torch thread each) over a Llama-shaped checkpoint with random
weights (GQA: 8 query heads, 2 KV heads, so at T = 4 each KV head lives on two ranks). A
rank loads only its slices of the safetensors file, then times a prefill step (4 prompts of
``--prompt`` tokens) and decode steps (``--batch`` sequences), median of ``--steps``; the
communication share is the time rank 0 spent inside its collectives (a TimedCommunicator)
over its step time. On a CPU shared by T processes the step time measures the overhead of
the split, not a speed-up: T ranks on fewer cores than T only take turns.

    .venv/bin/python benchmarks/bench_tp.py            # hidden 512, 4 layers, vocab 8192
    .venv/bin/python benchmarks/bench_tp.py --quick    # hidden 128, 2 layers, seconds
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.comm import TimedCommunicator, WorldSpec, join_world
from deepinfer_kit.engine.runner.assemble import load_model
from deepinfer_kit.models.attention import make_attention_metadata
from deepinfer_kit.models.parallel import attention_shard
from deepinfer_kit.models.records import ForwardBatch

BLOCK = 16


def make_checkpoint(folder: Path, quick: bool) -> None:
    """A random Llama checkpoint (safetensors) in ``folder``."""
    import transformers as T

    size = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, vocab_size=1024) if quick \
        else dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, vocab_size=8192)
    config = T.LlamaConfig(**size, num_attention_heads=8, num_key_value_heads=2,
                           max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    T.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)


def _batch(lengths: list[int], contexts: list[int], vocab: int) -> tuple[ForwardBatch, int]:
    """A step computing ``lengths[r]`` new tokens of a sequence of ``contexts[r]`` tokens."""
    tables, start = [], 0
    for c in contexts:
        n = -(-c // BLOCK)
        tables.append(list(range(start, start + n)))
        start += n
    ids = torch.randint(0, vocab, (sum(lengths),), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(c - n, c) for n, c in zip(lengths, contexts)])
    meta = make_attention_metadata(lengths, contexts, tables, BLOCK)
    ends = torch.tensor(lengths).cumsum(0) - 1
    return ForwardBatch(input_ids=ids, positions=positions, attn=meta, logits_indices=ends), start


def rank_main(rank: int, world: int, port: int, folder: str, args: Any, out: Any) -> None:
    """One rank: load its shard, time the steps, report to ``out``."""
    torch.set_num_threads(1)
    comm = None
    if world > 1:
        groups = join_world(WorldSpec(rank, world, f"tcp://127.0.0.1:{port}"), tensor_parallel=world,
                            expert_parallel=1, timeout=300, device=torch.device("cpu"))
        comm = TimedCommunicator(groups.tp)
    model = load_model(folder, attention_impl="ref", tp=comm).model
    c = model.config
    heads = c.num_kv_heads if comm is None else attention_shard(c, world, rank).num_kv_heads
    prefill, blocks = _batch([args.prompt] * 4, [args.prompt] * 4, c.vocab_size)
    decode, more = _batch([1] * args.batch, [args.prompt] * args.batch, c.vocab_size)
    cache = PagedKVCache(c.num_layers, max(blocks, more), BLOCK, heads, c.head_dim, impl="ref")
    result: dict[str, Any] = {"rank": rank, "bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
    for name, batch in (("prefill", prefill), ("decode", decode)):
        times, comms = [], []
        for i in range(args.steps + 2):
            if comm is not None:
                comm.barrier()
                comm.take()
            start = time.perf_counter()
            model.forward(batch, cache)
            elapsed = time.perf_counter() - start
            if i >= 2:  # two warm-up steps
                times.append(elapsed)
                comms.append(comm.take().seconds if comm is not None else 0.0)
        result[name] = statistics.median(times)
        result[name + "_comm"] = statistics.median(c / t for c, t in zip(comms, times))
    out.put(result)


def run(world: int, folder: str, args: Any) -> list[dict[str, Any]]:
    """Every rank's report for one T."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, folder, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    reports = [out.get(timeout=900) for _ in procs]
    for p in procs:
        p.join()
    return sorted(reports, key=lambda r: r["rank"])


def bound(folder: str, world: int) -> tuple[int, int]:
    """``(dense bytes, dense / T + replicated)``: the norms and row-parallel biases, one KV
    head's k/v rows per layer when KV heads < T, and the vocabulary padding rows."""
    whole = load_model(folder).model
    c = whole.config
    dense = sum(p.numel() * p.element_size() for p in whole.parameters())
    replicated = sum(p.numel() * p.element_size() for n, p in whole.named_parameters() if "norm" in n)
    if world > 1 and c.num_kv_heads < world:
        replicated += c.num_layers * 2 * c.head_dim * c.hidden_size * 4
    pad = -(-c.vocab_size // world) * world - c.vocab_size
    replicated += 2 * pad * c.hidden_size * 4  # embedding and LM head rows
    return dense, int(dense / world + replicated)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.prompt, args.batch = 3, 32, 4
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (step times on a shared "
          f"machine are noisy; ratios are within this run)")
    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(Path(tmp), args.quick)
        base: dict[str, float] = {}
        print(f"{'T':>2} {'prefill ms':>10} {'x T=1':>6} {'comm':>6} {'decode ms':>10} {'x T=1':>6} "
              f"{'comm':>6} {'bytes/rank (max)':>17} {'dense/T+repl':>13} {'dense':>10}")
        for world in (int(w) for w in args.worlds.split(",")):
            reports = run(world, tmp, args)
            head = reports[0]
            base = base or {k: head[k] for k in ("prefill", "decode")}
            dense, limit = bound(tmp, world)
            held = max(r["bytes"] for r in reports)
            print(f"{world:>2} {head['prefill'] * 1e3:>10.1f} {head['prefill'] / base['prefill']:>6.2f} "
                  f"{head['prefill_comm']:>6.1%} {head['decode'] * 1e3:>10.1f} "
                  f"{head['decode'] / base['decode']:>6.2f} {head['decode_comm']:>6.1%} "
                  f"{held:>17,} {limit:>13,} {dense:>10,}  {'ok' if held <= limit else 'OVER'}")


if __name__ == "__main__":
    main()
