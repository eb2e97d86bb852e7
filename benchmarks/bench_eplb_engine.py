"""Replica selectors end to end: the expert-parallel engine (gloo ranks) under skewed routing.

Each rank is a worker process holding ``P / W`` expert slots of every MoE layer of the tiny
model; EPLB places ``num_redundant`` extra replicas from the routed load and the selector
(``eplb.dispatch``: static, even, balanced) splits each batch's copies over them. A probe
installed in every worker (``worker_setup``) skews the routing the same way in every run
(a fixed share of tokens, by position, has its first choice replaced by expert 0) and
times, per rank: the MoE layers (dispatch + experts + combine, collectives included), the
expert compute alone and the selector, and counts the copies each rank's experts receive.
Printed per selector: the mean MoE time per step (the slowest rank's, which every rank
waits for), the exchange (MoE time less expert compute: counts, all-to-alls, combine; the
slowest rank's), each rank's expert-compute time, the straggler's share of the step (the
slowest rank's expert time over the engine's step), how evenly the copies were spread
over the ranks (copies-weighted mean over MoE calls of mean / max copies per rank: a
figure of the dispatch alone, not of the machine's timing) and the selector's cost as a
share of the engine's step. The greedy tokens of the three runs are compared.

    .venv/bin/python benchmarks/bench_eplb_engine.py              # W=4, skew 0.7
    .venv/bin/python benchmarks/bench_eplb_engine.py --ranks 2 --requests 4 --tokens 8
    .venv/bin/python benchmarks/bench_eplb_engine.py --ranks 2 --expert-size 4096 --repeats 4   # experts that weigh
    .venv/bin/python benchmarks/bench_eplb_engine.py --selector-cost    # one process, W virtual GPUs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import eplb_selector_cost

from deepinfer_kit import SamplingParams, build_engine


def run(dispatch: str, args: argparse.Namespace) -> tuple[list[list[int]], dict[str, Any]]:
    """One engine run; returns the greedy tokens and the measurements."""
    from deepinfer_kit.testing.eplb_probe import Probe  # pickled into each rank by reference

    with tempfile.TemporaryDirectory() as out:
        eplb = {"window": 8, "interval": args.interval, "num_redundant": args.ranks, "num_gpus": args.ranks,
                "policy": "deepseek", "dispatch": dispatch}
        engine = build_engine(model=args.model, worker="process", expert_parallel=args.ranks, eplb=eplb,
                              max_num_batched_tokens=args.batch_tokens, worker_setup=Probe(out, args.skew, args.threads_per_rank))
        params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
        prompts = [list(range(3 * i, 3 * i + 24)) for i in range(args.requests)]
        try:
            ids = [engine.add_request(None, p, params) for p in prompts]
            steps: list[float] = []
            outs = {}
            while engine.has_unfinished_requests():
                start = time.perf_counter()
                for o in engine.step():
                    outs[o.request_id] = o
                steps.append(time.perf_counter() - start)
            for o in engine.flush():
                outs[o.request_id] = o
            rebalances = len(engine.balancer.history) if engine.balancer is not None else 0
        finally:
            engine.close()
        ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(args.ranks)]
    tokens = [outs[i].outputs[0].token_ids for i in ids]
    return tokens, {"steps": steps, "ranks": ranks, "rebalances": rebalances}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=24, help="new tokens per request")
    parser.add_argument("--batch-tokens", type=int, default=256)
    parser.add_argument("--interval", type=int, default=4, help="EPLB interval (steps)")
    parser.add_argument("--skew", type=float, default=0.7, help="share of tokens whose first choice is expert 0")
    parser.add_argument("--repeats", type=int, default=2, help="runs per selector, in alternating order")
    parser.add_argument("--selector-cost", action="store_true",
                        help="time the selectors inside decode steps of one process (W virtual GPUs) instead")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (--selector-cost)")
    parser.add_argument("--threads-per-rank", type=int, default=1, help="torch threads in each rank's process")
    parser.add_argument("--expert-size", type=int, default=0,
                        help="> 0: a random Mixtral-style checkpoint (hidden 512, 8 experts of this "
                             "intermediate size, top-2, 2 layers) instead of the tiny model, so the experts weigh")
    args = parser.parse_args()
    args.model = "tiny"
    if args.expert_size > 0:
        args.model = big_expert_checkpoint(args.expert_size, tempfile.mkdtemp(prefix="eplb_big_"))
    if args.selector_cost:
        eplb_selector_cost.main(args)
        return
    print(f"W={args.ranks} requests={args.requests} new tokens={args.tokens} skew={args.skew} "
          f"threads per rank {args.threads_per_rank} load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(f"{'dispatch':<10}{'steps':>6}{'step ms':>9}{'moe ms/step':>12}{'exchange':>10}"
          f"{'experts ms/step per rank':>34}{'straggler/step':>15}{'copies mean/max':>16}{'select %':>9}")
    order = ("static", "even", "balanced")
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in order}
    tokens: dict[str, list[list[int]]] = {}
    for rep in range(args.repeats):  # alternate the order: a loaded machine drifts
        for dispatch in order if rep % 2 == 0 else order[::-1]:
            tokens[dispatch], m = run(dispatch, args)
            runs[dispatch].append(m)
            steps = len(m["steps"])
            step_ms = statistics.fmean(m["steps"]) * 1e3
            moe = max(r["moe"] for r in m["ranks"]) / steps * 1e3
            exchange = max(r["moe"] - r["experts"] for r in m["ranks"]) / steps * 1e3
            experts = [r["experts"] / steps * 1e3 for r in m["ranks"]]
            select = max(r["select"] for r in m["ranks"]) / steps * 1e3
            calls = list(zip(*(r["copies"] for r in m["ranks"])))  # per MoE call: copies on each rank
            m["moe_ms"], m["balance"] = moe, copies_balancedness(calls)
            print(f"{dispatch:<10}{steps:>6}{step_ms:>9.1f}{moe:>12.1f}{exchange:>10.1f}"
                  f"{' '.join(f'{e:7.2f}' for e in experts):>34}{max(experts) / step_ms:>15.3f}"
                  f"{m['balance']:>16.4f}{100 * select / step_ms:>8.2f}%")
            print(f"{'':<10}in the MoE layers, ms/step per rank: all_gather "
                  + " ".join(f"{r['all_gather'] / steps * 1e3:.1f}" for r in m["ranks"])
                  + "; all_to_all_single " + " ".join(f"{r['all_to_all_single'] / steps * 1e3:.1f}" for r in m["ranks"]))
    same = tokens["static"] == tokens["even"] == tokens["balanced"]
    base = statistics.median(m["moe_ms"] for m in runs["static"])
    for name in ("even", "balanced"):
        got = statistics.median(m["moe_ms"] for m in runs[name])
        print(f"median MoE time per step, static / {name}: {base / got:.3f}x over {args.repeats} runs each; "
              f"copies per rank mean/max {runs[name][0]['balance']:.4f} (static {runs['static'][0]['balance']:.4f})")
    print(f"rebalances per run: {[m['rebalances'] for n in order for m in runs[n]]}; "
          f"greedy tokens identical: {same}")


def big_expert_checkpoint(expert_size: int, folder: str) -> str:
    """A random Mixtral-style checkpoint saved to ``folder`` (hidden 512, 2 layers, 8
    experts of ``expert_size``, top-2, vocabulary 512), whose experts dominate a step's
    work; returns ``folder``. Seeded: the same weights every run."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=512, hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
        intermediate_size=expert_size, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
        eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def copies_balancedness(calls: list[tuple[int, ...]]) -> float:
    """Copies-weighted mean over MoE calls of (mean / max copies a rank's experts received):
    how evenly the selector spread the work, independent of the machine's timing."""
    busy = [c for c in calls if max(c) > 0]
    return sum(sum(c) / len(c) for c in busy) / sum(max(c) for c in busy) if busy else 1.0

if __name__ == "__main__":
    main()
