"""KV tiers on the real engine: a multi-turn workload whose prefix working set is about 4x
the device KV pool, run three ways on the tiny model (greedy, CPU) — device pool only,
+ a host tier (2x the pool), + host and disk tiers (disk in a tempdir that holds the
whole working set) — plus the host+disk config with ``write_back`` instead of
``write_through``; every row against the device-only run of the same process.

Workloads (``--workload``):

- ``conv`` (default): conversations over a few shared system prompts, interleaved in a
  seeded random order; turn k+1's prompt is turn k's prompt, the tokens turn k generated
  and a new user message (so each turn's prefix is the whole previous turn).
- ``mooncake``: the first requests of Mooncake's conversation trace
  (``shared/traces/mooncake_conversation_trace.jsonl``, FAST'25, Apache-2.0): each
  ``hash_id`` (a 512-token block there) becomes one block of ``P`` seeded tokens, so equal
  ids give equal blocks; outputs scaled down by 64 (1 to 16 tokens).

Requests are added in one fixed order, at most ``max_num_seqs`` outstanding (a turn waits
for its previous turn to finish), so every config serves the same request sequence.

Columns: prefix hit rate (prompt tokens served from any cache / prompt tokens), prefill
tokens computed (from the step traces, recomputation included) and saved against the
device-only run, the tiers' counters, wall time, and whether every request generated the
same tokens as the device-only run (greedy: a tier load must give the K/V a recompute
gives). A second table times the device side's transfers: ``HostTransferWorker``'s
``start_save_kv`` / ``start_load_kv``, the forward's waits for loads
(``wait_for_layer_load``, ``wait_for_load``: the loads are copied beside the forward, layer
by layer) and ``get_finished`` (which settles the saves into the host slab on the CPU) are
wrapped on the engine's instance, per round that carried
transfers, against the mean round (schedule + execute + commit); and, in total, the
connector's scheduler-side calls (``OffloadConnector``: disk reads are waited for there).
The hit rate of a cache that forgets nothing bounds every row.

Torch runs one intra-op thread by default (``--threads``): on a 2-core machine shared with
other processes, two threads made the tiny model's rounds 5 to 10 times slower (spinning
thread barriers), which buried every difference between the configs. A short warm-up run
precedes the measured ones (the first engine of a process pays one-time costs).

    .venv/bin/python benchmarks/bench_kv_tiers.py [--quick] [--workload conv|mooncake]
        [--seed S] [--threads N] [--batch-invariant] [--overlap] [--worker process [--tensor-parallel T]]
        [--hybrid W]

With ``--hybrid W`` the model is a random Qwen2 of 5 sliding layers (window ``W``) to 1 full
one under the hybrid KV cache: a tier block keeps every layer (the sliding layers' windows
too), so a prefix loaded from a tier needs no recompute; bounded replays still serve device
hits whose windows the device evicted (counted in the prefill column, and per row below the
table), and saves whose window had gone are refused (counted below it).

With ``--worker process`` the model runs in worker processes (``--tensor-parallel`` of
them), each holding its heads' host tier in shared memory; the tiers' decisions are the
scheduler's, so the hit rates match the in-process run's, and wall time shows what the
process boundary costs. The device side's transfers are not timed then.

``--quick`` takes about 10 s, the default about 40 s (2 cores). No timing is asserted:
the times are this machine's.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

from bench_hybrid_kv import tiny_checkpoint
from deepinfer_kit.cache.tiers.manager import tiered
from deepinfer_kit.engine.build import build_engine
from deepinfer_kit.engine.trace import StepTrace
from deepinfer_kit.sample.params import SamplingParams

P = 16  # tokens per block
MAX_NUM_SEQS = 8
TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


@attrs.define
class Item:
    """One request: its prompt is its conversation's history (the previous turn's prompt
    and output; empty for a first turn) followed by ``fresh``."""

    rid: str
    conv: int
    fresh: list[int]
    max_tokens: int


@attrs.define
class Workload:
    items: list[Item]
    pool: int  # device blocks
    working_set: int  # distinct full prompt blocks (planned)
    longest: int  # tokens of the longest request (prompt + output)


CONV = {True: (16, 6, 16, 2), False: (96, 12, 96, 8)}  # quick?: conversations, turns, open at once, system prompts


def conv_workload(quick: bool, seed: int) -> list[Item]:
    """Conversations (see the module docstring), ``active`` open at a time, each turn taken
    from a seeded random open conversation."""
    rng = random.Random(seed)
    n_conv, turns, active, n_sys = CONV[quick]
    systems = [[rng.randrange(256) for _ in range(rng.randint(48, 96))] for _ in range(n_sys)]
    todo = list(range(n_conv))
    left: dict[int, int] = {}
    items: list[Item] = []
    while todo or left:
        while todo and len(left) < active:
            left[todo.pop(0)] = turns
        c = rng.choice(sorted(left))
        first = left[c] == turns
        user = [rng.randrange(256) for _ in range(rng.randint(48, 128) if first else rng.randint(24, 64))]
        items.append(Item(f"c{c}t{turns - left[c]}", c, (systems[c % n_sys] + user) if first else user, 16))
        left[c] -= 1
        if not left[c]:
            del left[c]
    return items


def mooncake_workload(quick: bool, seed: int) -> list[Item]:
    """The first requests of Mooncake's trace, one block of ``P`` tokens per hash id, at
    most 48 blocks a prompt (a prefix of it: reuse is kept)."""
    n = 120 if quick else 400
    items: list[Item] = []
    with open(TRACE, encoding="utf-8") as f:
        for i, line in zip(range(n), f):
            row = json.loads(line)
            toks = [t for h in row["hash_ids"][:48]
                    for t in random.Random(seed * 1_000_003 + h).choices(range(256), k=P)]
            items.append(Item(f"m{i}", -1 - i, toks, max(1, min(16, row["output_length"] // 64))))
    return items


def plan(items: list[Item]) -> Workload:
    """Size the device pool to a quarter of the working set (distinct full prompt blocks;
    outputs are placeholder tokens here, unique per turn, which give the same count)."""
    history: dict[int, list[int]] = {}
    seen: set[int] = set()
    longest = 0
    for k, it in enumerate(items):
        prompt = history.get(it.conv, []) + it.fresh
        longest = max(longest, len(prompt) + it.max_tokens)
        seen.update(block_keys(prompt))
        history[it.conv] = prompt + [-(k * 100 + j) - 1 for j in range(it.max_tokens)]
    ws = len(seen)
    pool = max(-(-ws // 4), 2 * -(-longest // P))
    return Workload(items, pool, ws, longest)


def block_keys(tokens: list[int]) -> list[int]:
    """Chained identities of the full blocks of ``tokens`` (a block is its whole prefix)."""
    keys, h = [], 0
    for j in range(len(tokens) // P):
        h = hash((h, tuple(tokens[j * P:(j + 1) * P])))
        keys.append(h)
    return keys


def timed(obj: Any, name: str, sink: Callable[[float, tuple[Any, ...]], None]) -> None:
    """Replace ``obj.name`` (on this instance only) by a wrapper reporting its seconds."""
    fn = getattr(obj, name)

    def wrapper(*a: Any) -> Any:
        t = time.perf_counter()
        out = fn(*a)
        sink(time.perf_counter() - t, a)
        return out

    setattr(obj, name, wrapper)


class TransferTimer:
    """Times the engine's ``HostTransferWorker`` (the device side: saves, loads, and
    ``get_finished``, which settles the saves into the slab), per round, with the blocks
    moved; and the connector's scheduler-side calls (disk reads land there), in total."""

    CONNECTOR = ("on_arrival", "get_num_new_matched_tokens", "update_state_after_alloc", "on_published",
                 "on_evicted", "build_transfers", "update_from_output", "request_finished")

    def __init__(self, worker: Any, connector: Any) -> None:
        self.cur = [0.0, 0, 0]  # seconds, saves, loads of the round in progress
        self.rounds: list[tuple[float, int, int]] = []
        self.connector_s = 0.0
        timed(worker, "start_save_kv", lambda s, a: self._add(s, len(a[0].saves), 0))
        timed(worker, "start_load_kv", lambda s, a: self._add(s, 0, len(a[0].loads)))
        timed(worker, "get_finished", lambda s, a: self._add(s, 0, 0))
        for name in ("wait_for_layer_load", "wait_for_load"):  # a layerwise load's waits (the copy runs beside)
            timed(worker, name, lambda s, a: self._add(s, 0, 0))
        for name in self.CONNECTOR:
            timed(connector, name, self._add_connector)

    def _add(self, seconds: float, saves: int, loads: int) -> None:
        self.cur[0] += seconds
        self.cur[1] += saves
        self.cur[2] += loads

    def _add_connector(self, seconds: float, _: tuple[Any, ...]) -> None:
        self.connector_s += seconds

    def end_round(self) -> None:
        if self.cur[1] or self.cur[2]:
            self.rounds.append((self.cur[0], int(self.cur[1]), int(self.cur[2])))
        self.cur = [0.0, 0, 0]


@attrs.define
class Result:
    name: str
    prompt: int = 0
    cached: int = 0
    computed: int = 0
    device_hits: int = 0
    wall: float = 0.0
    cpu: float = 0.0
    round_s: list[float] = attrs.Factory(list)
    tokens: dict[str, list[int]] = attrs.Factory(dict)
    stats: Any = None
    timer: TransferTimer | None = None
    block_bytes: int = 0
    prompts: list[tuple[str, list[int]]] = attrs.Factory(list)  # in the order added
    replays: int = 0  # hybrid cache: hits whose windows were recomputed, and the tokens they recomputed
    replayed: int = 0
    dropped: int = 0  # hybrid cache over tiers: saves refused, their window gone


def run(name: str, wl: Workload, tiers: dict[str, Any] | None, args: argparse.Namespace) -> Result:
    """Serve ``wl`` on a fresh engine with ``tiers``; check it idle afterwards."""
    model = {"model": args.model} if args.model else {}
    e = build_engine(num_blocks=wl.pool, block_size=P, max_num_seqs=MAX_NUM_SEQS,
                     max_model_len=min(wl.pool * P, 4096), kv_tiers=tiers, seed=0,
                     batch_invariant=args.batch_invariant, worker=args.worker,
                     tensor_parallel=args.tensor_parallel, overlap=args.overlap, **model)
    res = Result(name)
    plain: Any = getattr(e.runner, "runner", e.runner)  # the ModelRunner holding the pool (inline)
    cache: Any = tiered(e.cache) or e.cache  # the TieredKVCacheManager (under a hybrid cache's) when tiers are on
    if tiers is not None and args.worker == "inline":  # in workers the device side is out of reach
        res.timer = TransferTimer(plain.kv_transfer, cache.connector)
    if args.worker == "inline":
        kv = plain.kv_cache  # every layer of a block, a hybrid cache's too
        res.block_bytes = kv.dtype.itemsize * math.prod(kv.block_shape)  # [L, K/V, P, Hkv, D]

    def on_trace(tr: StepTrace) -> None:
        res.computed += sum(c.num_tokens for c in tr.chunks if c.kind == "prefill")
        res.round_s.append(tr.schedule_s + tr.execute_s + tr.commit_s)
        if res.timer is not None:
            res.timer.end_round()

    e.subscribe(on_trace)
    history: dict[int, list[int]] = {}
    busy: dict[str, tuple[int, list[int]]] = {}  # rid -> (conversation, prompt)
    i = 0
    t0, c0 = time.perf_counter(), time.process_time()
    while i < len(wl.items) or busy:
        while i < len(wl.items) and len(busy) < MAX_NUM_SEQS and wl.items[i].conv not in {c for c, _ in busy.values()}:
            it = wl.items[i]
            prompt = history.pop(it.conv, []) + it.fresh
            sp = SamplingParams(max_tokens=it.max_tokens, temperature=0.0, ignore_eos=True)
            e.add_request(it.rid, prompt, sp)
            busy[it.rid] = (it.conv, prompt)
            res.prompts.append((it.rid, prompt))
            i += 1
        for out in e.step() + e.flush():
            conv, prompt = busy.pop(out.request_id)
            toks = list(out.outputs[0].token_ids)
            res.tokens[out.request_id] = toks
            history[conv] = prompt + toks
    res.wall, res.cpu = time.perf_counter() - t0, time.process_time() - c0
    e.check_idle()
    res.prompt, res.cached = e.num_prompt_tokens, e.num_cached_prompt_tokens
    if tiers is not None:
        res.stats = attrs.evolve(cache.tier_stats)  # a copy, before close drains the disk writes
    # device hits: PrefixCacheStats.hit_blocks counts every match_prefix call, and the scheduler
    # matches a waiting request again each round it does not fit: read what was served instead
    res.device_hits = res.cached - (res.stats.loaded_tokens if res.stats else 0)
    windows = getattr(e.cache, "window_stats", None)  # a hybrid cache: hits served by a bounded replay
    if windows is not None:
        res.replays, res.replayed = windows.replays, windows.replayed_tokens
        res.dropped = getattr(e.cache, "refused_saves", 0)
    e.close()
    return res


def unbounded_hit_rate(res: Result) -> float:
    """Prompt tokens a cache that forgets nothing could serve: each prompt's leading full
    blocks (its last token excepted) published by a request added before it."""
    seen: set[int] = set()
    hits = total = 0
    for rid, prompt in res.prompts:
        keys = block_keys(prompt)[:(len(prompt) - 1) // P]
        hits += P * next((j for j, k in enumerate(keys) if k not in seen), len(keys))
        total += len(prompt)
        seen.update(block_keys(prompt + res.tokens[rid][:-1]))
    return hits / total


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smaller workload (well under a minute)")
    ap.add_argument("--workload", choices=("conv", "mooncake"), default="conv")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: a shared 2-core machine runs 10x slower with 2)")
    ap.add_argument("--batch-invariant", action="store_true", help="EngineConfig.batch_invariant=True")
    ap.add_argument("--overlap", action="store_true", help="EngineConfig.overlap=True (plan a round ahead)")
    ap.add_argument("--worker", choices=("inline", "process"), default="inline",
                    help="process: the model in worker processes (the host tier in shared memory)")
    ap.add_argument("--tensor-parallel", type=int, default=1, help="ranks (needs --worker process)")
    ap.add_argument("--hybrid", type=int, default=0, metavar="W",
                    help="a random 5 sliding (window W) : 1 full Qwen2 instead of the tiny model (hybrid KV cache)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.model = None

    make = conv_workload if args.workload == "conv" else mooncake_workload
    wl = plan(make(args.quick, args.seed))
    host = 2 * wl.pool
    print(f"workload {args.workload}{' (quick)' if args.quick else ''}: {len(wl.items)} requests, "
          f"block size {P}, max_num_seqs {MAX_NUM_SEQS}, longest request {wl.longest} tokens")
    print(f"working set {wl.working_set} distinct prefix blocks; device pool {wl.pool} blocks "
          f"({wl.working_set / wl.pool:.1f}x); host tier {host} blocks; disk tier {2 * wl.working_set} blocks")

    with tempfile.TemporaryDirectory(prefix="bench_kv_tiers_") as tmp:
        if args.hybrid:
            args.model = str(Path(tmp) / "model")
            tiny_checkpoint(Path(args.model), args.hybrid, 4096 - 256)  # positions up to 4096, as the tiny model's
            print(f"model: a random Qwen2, 5 sliding layers (window {args.hybrid}) : 1 full, hybrid KV cache; "
                  f"the tiers keep every layer, windows included")

        def disk(policy: str) -> dict[str, Any]:
            return {"host_blocks": host, "disk_blocks": 2 * wl.working_set,
                    "disk_path": str(Path(tmp) / policy), "write_policy": policy}

        configs: list[tuple[str, dict[str, Any] | None]] = [
            ("device only", None),
            ("+host", {"host_blocks": host}),
            ("+host+disk", disk("write_through")),
            ("+host+disk write_back", disk("write_back")),
        ]
        run("warm-up", attrs.evolve(wl, items=wl.items[:MAX_NUM_SEQS]), None, args)
        results = [run(name, wl, tiers, args) for name, tiers in configs]

    base = results[0]
    measured = {k for _, p in base.prompts for k in block_keys(p)}
    print(f"working set measured on the device-only run's prompts: {len(measured)} blocks "
          f"({len(measured) / wl.pool:.1f}x the pool); hit rate of an unbounded cache: "
          f"{unbounded_hit_rate(base):.1%}\n")
    head = (f"{'config':<23}{'hit rate':>9}{'dev hit':>8}{'prefill':>9}{'saved':>8}{'vs dev':>7}"
            f"{'host_hits':>10}{'disk_hits':>10}{'saved_host':>11}{'saved_disk':>11}{'ev_host':>8}"
            f"{'wall s':>8}{'cpu s':>7}{'x dev':>7}  same tokens")
    print(head)
    print("-" * len(head))
    for r in results:
        s = r.stats
        same = r.tokens == base.tokens
        cols = (s.host_hits, s.disk_hits, s.saved_host, s.saved_disk, s.evicted_host) if s else ("-",) * 5
        saved = base.computed - r.computed
        print(f"{r.name:<23}{r.cached / r.prompt:>9.1%}{r.device_hits / r.prompt:>8.1%}{r.computed:>9}"
              f"{saved:>8}{saved / base.computed:>7.1%}{cols[0]:>10}{cols[1]:>10}{cols[2]:>11}{cols[3]:>11}"
              f"{cols[4]:>8}{r.wall:>8.2f}{r.cpu:>7.2f}{r.wall / base.wall:>7.2f}  {same}")
    identical = all(r.tokens == base.tokens for r in results)
    for r in results[1:]:
        if r.tokens != base.tokens:
            diff = [k for k in base.tokens if r.tokens.get(k) != base.tokens[k]]
            print(f"  {r.name}: {len(diff)} of {len(base.tokens)} requests differ, first {diff[:5]}")
    print(f"tokens identical: {identical}")
    print("(hit rate: prompt tokens from any cache / prompt tokens; dev hit: from the device pool; "
          "prefill: prompt tokens computed, recomputation included; saved, vs dev: against device only)\n")
    if args.hybrid:
        for r in results:
            print(f"{r.name:<23} bounded replays {r.replays:>6}, tokens they recomputed {r.replayed:>8} "
                  f"(in 'prefill'); blocks without their window when a save was considered {r.dropped:>6}")
        print()

    head = (f"{'config':<23}{'rounds':>7}{'w/ xfer':>8}{'mean ms':>8}{'p50 ms':>8}{'p99 ms':>8}"
            f"{'saves/rd':>9}{'loads/rd':>9}{'MB/rd':>7}{'round ms':>9}{'xfer/round':>11}{'xfer/wall':>10}"
            f"{'conn s':>8}{'conn/wall':>10}")
    print(f"device-side transfers per round that carried any (HostTransferWorker start_save_kv + "
          f"start_load_kv + the load waits + get_finished), {base.block_bytes} bytes per block")
    if results[1].timer is None:
        print("(the device side runs in the worker processes: its transfers are not timed here)")
        return
    print(head)
    print("-" * len(head))
    for r in results[1:]:
        assert r.timer is not None
        t = r.timer.rounds
        ms = [x[0] * 1e3 for x in t]
        mean_round = statistics.fmean(r.round_s) * 1e3
        saves = statistics.fmean(x[1] for x in t) if t else 0.0
        loads = statistics.fmean(x[2] for x in t) if t else 0.0
        mean = statistics.fmean(ms) if ms else 0.0
        print(f"{r.name:<23}{len(r.round_s):>7}{len(t):>8}{mean:>8.3f}{pct(ms, 0.5):>8.3f}{pct(ms, 0.99):>8.3f}"
              f"{saves:>9.1f}{loads:>9.1f}{(saves + loads) * r.block_bytes / 2**20:>7.2f}{mean_round:>9.2f}"
              f"{mean / mean_round:>11.1%}{sum(ms) / 1e3 / r.wall:>10.1%}"
              f"{r.timer.connector_s:>8.2f}{r.timer.connector_s / r.wall:>10.1%}")
    print(f"(round ms: mean over every round of that run; xfer/round: mean transfer ms / mean round ms; "
          f"xfer/wall: all transfer time / wall; conn s: time in the connector's scheduler-side calls "
          f"(disk reads and host puts included); device-only rounds: {len(base.round_s)}, "
          f"mean {statistics.fmean(base.round_s) * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
