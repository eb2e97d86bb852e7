"""Speculative decoding (a): plain decoding vs the n-gram drafter on the real engine, CPU.

The embedded tiny model, batch 1, greedy. Two workloads: repetitive text (the prompt
repeats a sentence; prompt lookup finds the model's continuations when it loops) and
random token ids (drafts rarely match). Each configuration runs the same prompts in the
same process, alternating, best of ``--repeats``. Prints output tokens/s, the ratio to
plain, and the mean acceptance length (tokens emitted per verify round, ``1 + accepted``)
and the share of decode rounds that verified drafts. Outputs are checked equal to plain.

    .venv/bin/python benchmarks/bench_spec.py [--quick] [--tokens 128] [--gamma 4]
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch

from deepinfer_kit import SamplingParams, build_engine
from deepinfer_kit.engine.trace import StepTrace


def _workloads(num: int) -> dict[str, list[list[int]]]:
    rng = random.Random(0)
    text = [list(f"Request {i}: the cat sat on the mat and the dog sat on the log. ".encode() * 3)
            for i in range(num)]
    rand = [[rng.randrange(256) for _ in range(48)] for _ in range(num)]
    return {"repetitive": text, "random": rand}


def _run(spec: dict[str, Any] | None, prompts: list[list[int]], tokens: int) -> tuple[float, list[Any], list[StepTrace]]:
    engine = build_engine(speculative=spec, num_blocks=256, max_model_len=1024)
    traces: list[StepTrace] = []
    engine.trace = traces.append
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    outs: list[Any] = []
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):  # batch 1: one request at a time
        engine.add_request(f"r{i}", p, params)
        outs += [o.outputs[0].token_ids for o in engine.run()]
    return time.perf_counter() - t0, outs, traces


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    num, tokens, repeats = (2, 32, 1) if args.quick else (6, args.tokens, args.repeats)
    configs: dict[str, dict[str, Any] | None] = {
        "plain": None,
        f"ngram γ={args.gamma} fixed": {"num_draft": args.gamma},
        f"ngram γ={args.gamma} threshold 0.5": {"num_draft": args.gamma, "planner": "threshold",
                                                 "threshold": 0.5},
    }
    for name, prompts in _workloads(num).items():
        best = {c: float("inf") for c in configs}
        stats: dict[str, tuple[float, float]] = {}
        reference: list[Any] | None = None
        for _ in range(repeats):
            for cname, spec in configs.items():
                dt, outs, traces = _run(spec, prompts, tokens)
                reference = outs if reference is None else reference
                if outs != reference:
                    raise SystemExit(f"{cname} on {name}: output differs from plain")
                best[cname] = min(best[cname], dt)
                verify = [c for t in traces for c in t.chunks if c.num_drafted]
                decode = [c for t in traces for c in t.chunks if c.kind == "decode"]
                accept = sum(len(c.sampled) for c in verify) / len(verify) if verify else 1.0
                stats[cname] = (accept, len(verify) / max(1, len(decode)))
        total = num * tokens
        print(f"workload {name}: {num} prompts x {tokens} tokens, batch 1")
        for cname in configs:
            tps = total / best[cname]
            accept, share = stats[cname]
            print(f"  {cname:28s} {tps:8.1f} tok/s  x{best['plain'] / best[cname]:.2f} vs plain  "
                  f"mean acceptance length {accept:.2f}  verify rounds {share:.0%} of decodes")


if __name__ == "__main__":
    main()
