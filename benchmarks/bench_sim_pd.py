"""Prefill/decode disaggregation vs colocated serving at 64 GPUs: goodput under SLOs,
simulated (``deepinfer_kit.sim.disagg``: the real scheduler and KV cache manager per
instance, an analytic cost model, one virtual timeline).

64 H200s as 16 tensor-parallel instances of 4 GPUs serve a 70B-class dense model
(Llama-3.1-70B's shape): 16 colocated replicas (data parallel; chunked prefill with the
engine's default budget of 2048 tokens per round, and with 256, the budget that keeps
decode rounds short) against prefill:decode splits of the same 16 instances. Each
configuration sees the same chat workload at each rate (Poisson arrivals; prompts
lognormal, mean 3,000 tokens; outputs lognormal, mean 300).

Goodput = the requests whose TTFT <= the TTFT SLO and TPOT <= the TPOT SLO, given for
each TPOT SLO asked (a tight one, where decode interference matters, and a loose one):
as a fraction of the requests, as a rate over the arrival window ("good/s": good
requests per second of offered load, about rate x fraction; the run's own duration
would add the drain after the last arrival, which the longest output dominates), and
as the ratio to the better colocated fraction at the same rate. Throughput (req/s, out
tok/s) is over the whole run, drain included: at loads a configuration sustains it sits
below the offered rate.

    .venv/bin/python benchmarks/bench_sim_pd.py            # ~1.5 min on 2 cores
    .venv/bin/python benchmarks/bench_sim_pd.py --quick    # a smoke run, seconds
    .venv/bin/python benchmarks/bench_sim_pd.py --splits 8:8,12:4 --rates 40,80 -n 3000
"""

from __future__ import annotations

import argparse
import time

import attrs

from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.sim import H200, LengthDist, StepShape, WorkloadConfig, generate
from deepinfer_kit.sim.cost_tp import LLAMA3_70B, TensorParallel, TensorParallelCost
from deepinfer_kit.sim.disagg import ClusterSimulator, build_colocated, build_disaggregated
from deepinfer_kit.sim.disagg_records import ClusterReport, TransferLink
from deepinfer_kit.sim.records import SimRequest

GIB = 1 << 30


def workload(n: int, rate: float, seed: int) -> list[SimRequest]:
    """The chat workload at ``rate`` arrivals/s."""
    return generate(WorkloadConfig(
        num_requests=n, rate=rate, seed=seed,
        prompt_len=LengthDist("lognormal", 3000, 0.6, 64, 16000),
        output_len=LengthDist("lognormal", 300, 0.6, 1, 2000),
        shared_fraction=0.3, shared_prefix_len=512, num_shared_prefixes=4, eos_fraction=0.5,
    ))


def main() -> None:
    """Parse the flags, run every configuration at every rate, print the assumptions and
    the table. Exits with a message on a split that does not use ``--instances``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="300 requests, 2 rates, 4 configurations")
    ap.add_argument("-n", type=int, default=1200, help="requests per run")
    ap.add_argument("--rates", default="30,50,60,70,80", help="arrivals per second")
    ap.add_argument("--splits", default="4:12,6:10,8:8,10:6,12:4,13:3", help="prefill:decode instance counts")
    ap.add_argument("--colocated-budgets", default="2048,256", help="colocated tokens per round, one row each")
    ap.add_argument("--instances", type=int, default=16, help="instances (colocated replicas)")
    ap.add_argument("--tp", type=int, default=4, help="GPUs per instance (tensor parallel)")
    ap.add_argument("--ttft-slo", type=float, default=1.0, help="seconds")
    ap.add_argument("--tpot-slo", default="0.02,0.05", help="seconds, one goodput column each")
    ap.add_argument("--link-gbps", type=float, default=200.0, help="KV link, GB/s per instance")
    ap.add_argument("--link-latency-ms", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.quick:
        args.n, args.rates, args.splits = 300, "40,70", "8:8,12:4"
    rates = [float(r) for r in args.rates.split(",")]
    splits = [tuple(int(x) for x in s.split(":")) for s in args.splits.split(",")]
    slos = [float(s) for s in args.tpot_slo.split(",")]

    model, tp = LLAMA3_70B, TensorParallel(args.tp)
    cost = TensorParallelCost(model, H200, tp)
    link = TransferLink(args.link_gbps * 1e9, args.link_latency_ms / 1e3)
    kv_mb = args.tp * 80 * 1024  # 80 GiB of KV per GPU: 141 GB HBM less a 35 GB weight shard and headroom
    base = EngineConfig(kv_cache_memory_mb=kv_mb, max_model_len=32768)
    budgets = [int(b) for b in args.colocated_budgets.split(",")]
    colocated = [attrs.evolve(base, max_num_seqs=256, max_num_batched_tokens=b) for b in budgets]
    prefill = attrs.evolve(base, max_num_seqs=64, max_num_batched_tokens=8192)
    decode = attrs.evolve(base, max_num_seqs=256, max_num_batched_tokens=2048)
    for p, d in splits:
        if p + d != args.instances:
            raise SystemExit(f"split {p}:{d} does not use {args.instances} instances")
    print_assumptions(args, cost, link, kv_mb, colocated, prefill, decode)

    configs: list[tuple[str, object]] = [(f"colocated x{args.instances}, budget {c.max_num_batched_tokens}", c)
                                         for c in colocated]
    configs += [(f"P/D {p}:{d}", (p, d)) for p, d in splits]
    rows: list[tuple[str, float, ClusterReport]] = []
    wall = time.perf_counter()
    for rate in rates:
        reqs = workload(args.n, rate, args.seed)
        for name, split in configs:
            sim: ClusterSimulator
            if isinstance(split, EngineConfig):
                sim = build_colocated(split, cost, model, num_replicas=args.instances, seed=args.seed)
            else:
                p, d = split  # type: ignore[misc]
                sim = build_disaggregated(prefill, decode, cost, model, num_prefill=p, num_decode=d,
                                          link=link, seed=args.seed)
            rows.append((name, rate, sim.run(reqs)))
    print_table(rows, args.ttft_slo, slos)
    print(f"\n{len(rows)} runs of {args.n:,} requests in {time.perf_counter() - wall:.1f} s wall")


def print_assumptions(args: argparse.Namespace, cost: TensorParallelCost, link: TransferLink, kv_mb: int,
                      colocated: list[EngineConfig], prefill: EngineConfig, decode: EngineConfig) -> None:
    """Print what the cost model, link, pools, schedulers, router, workload and SLOs
    assume (the priced times are ``cost.step_time`` of the shapes named)."""
    m, g, tp = cost.model, cost.gpu, cost.tp
    kv_tok = m.kv_bytes_per_token
    mean_prompt = 3000
    pre = cost.step_time(StepShape(mean_prompt, 0, mean_prompt, 1, mean_prompt * (mean_prompt + 1) // 2, 1))
    dec1 = cost.step_time(StepShape(0, 1, mean_prompt, 1, mean_prompt, 1))
    dec64 = cost.step_time(StepShape(0, 64, 64 * 3150, 64, 64 * 3150, 64))
    print("assumptions")
    print(f"  GPUs: {args.instances} instances x TP-{tp.size} = {args.instances * tp.size} {g.name}s")
    print(f"  model: Llama-3.1-70B shape: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_q_heads} query / "
          f"{m.num_kv_heads} KV heads x {m.head_dim}, SwiGLU {m.intermediate_size}, vocab {m.vocab_size}, bf16; "
          f"{m.num_params / 1e9:.1f} B weights read per round, KV {kv_tok // 1024} KiB/token")
    print(f"  GPU roofline: {g.memory_bandwidth / 1e12:.1f} TB/s, {g.peak_flops / 1e12:.0f} TFLOP/s (100% of peak), "
          f"{g.step_overhead_s * 1e3:.1f} ms per round (not divided by TP)")
    print(f"  TP-{tp.size}: bytes and FLOPs / {tp.size}; 2 all-reduces per layer, each "
          f"{tp.allreduce_latency_s * 1e6:.0f} us + 2(n-1)/n x tokens x {m.hidden_size * m.dtype_bytes} B / "
          f"{tp.bus_bandwidth / 1e9:.0f} GB/s = {cost.comm_time(0) * 1e3:.2f} ms + "
          f"{(cost.comm_time(1) - cost.comm_time(0)) * 1e6:.1f} us/token per round")
    print(f"  priced: prefill of {mean_prompt:,} tokens {pre * 1e3:.0f} ms; "
          f"decode round of 1 seq {dec1 * 1e3:.1f} ms, "
          f"of 64 seqs at ~3.1k context {dec64 * 1e3:.1f} ms")
    print(f"  KV link: {link.bandwidth_bytes_per_s / 1e9:.0f} GB/s per instance ({tp.size} x 400 Gb/s NICs), "
          f"{link.latency_s * 1e3:.1f} ms per transfer, no contention; a {mean_prompt:,}-token prompt "
          f"({mean_prompt * kv_tok / 1e9:.2f} GB) takes {link.transfer_time(mean_prompt * kv_tok) * 1e3:.1f} ms")
    print(f"  KV pool per instance: {kv_mb // 1024} GiB = {kv_mb * (1 << 20) // kv_tok:,} tokens (block 16)")
    print(f"  schedulers (continuous, FCFS, prefix caching): colocated budget "
          f"{' or '.join(str(c.max_num_batched_tokens) for c in colocated)} (chunked prefill), "
          f"{colocated[0].max_num_seqs} seqs; prefill budget {prefill.max_num_batched_tokens}, "
          f"{prefill.max_num_seqs} seqs; decode {decode.max_num_seqs} seqs")
    print("  router: least outstanding tokens (prompt + max_tokens routed and not done), ties to the lowest index")
    print(f"  workload: {args.n:,} requests per run, Poisson; prompts lognormal mean 3,000 (sigma 0.6, 64..16,000), "
          f"outputs lognormal mean 300 (sigma 0.6, 1..2,000); 30% open with one of 4 512-token system prompts")
    tpots = [float(x) for x in args.tpot_slo.split(",")]
    print(f"  SLOs: TTFT <= {args.ttft_slo:g} s; TPOT <= " + " or ".join(f"{s * 1e3:g} ms" for s in tpots))
    print()


def print_table(rows: list[tuple[str, float, ClusterReport]], ttft_slo: float, slos: list[float]) -> None:
    """Print one markdown row per (configuration, rate) run, then the best configuration
    at each rate for each TPOT SLO."""
    colo = [(rate, rep) for name, rate, rep in rows if name.startswith("colocated")]
    head = ["config", "rate"]
    for s in slos:
        head += [f"good% @{s * 1e3:g}ms", "good/s", "vs coloc"]
    head += ["TTFT p50/p90 ms", "TPOT p50/p90 ms", "req/s", "out tok/s"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|")
    best: dict[tuple[float, float], tuple[float, str]] = {}
    for name, rate, rep in rows:
        r = rep.report
        cells = [name, f"{rate:g}"]
        for s in slos:
            g = rep.goodput(ttft_slo, s, rep.arrival_span_s)
            g0 = max((c.goodput(ttft_slo, s).fraction for r0, c in colo if r0 == rate), default=0.0)
            ratio = f"{g.fraction / g0:.2f}x" if g0 > 0 else "-"
            cells += [f"{g.fraction:.1%}", f"{g.rate_per_s:.1f}", ratio]
            if g.fraction > best.get((rate, s), (-1.0, ""))[0]:
                best[(rate, s)] = (g.fraction, name)
        cells += [f"{r.ttft.p50 * 1e3:,.0f} / {r.ttft.p90 * 1e3:,.0f}",
                  f"{r.tpot.p50 * 1e3:.1f} / {r.tpot.p90 * 1e3:.1f}",
                  f"{r.request_throughput:.1f}", f"{r.output_throughput:,.0f}"]
        print("| " + " | ".join(cells) + " |")
    print()
    for s in slos:
        line = ", ".join(f"{rate:g}/s: {best[(rate, s)][1]} ({best[(rate, s)][0]:.1%})"
                         for rate in sorted({rate for _, rate, _ in rows}))
        print(f"best at TPOT <= {s * 1e3:g} ms: {line}")


if __name__ == "__main__":
    main()
