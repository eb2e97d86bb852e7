"""The replica selector's cost inside a decode step: the tiny MoE model in one process,
``W`` virtual GPUs, routing skewed as in ``bench_eplb_engine.py``; each selector's run
times every decode step and every ``select`` call. Used by ``bench_eplb_engine.py
--selector-cost``."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from deepinfer_kit import SamplingParams, build_engine
from deepinfer_kit.moe.layer import MoELayer
from deepinfer_kit.moe.records import Routing


class _Timed:
    """A selector wrapper adding each ``select`` call's wall time to ``clock[0]``."""

    def __init__(self, inner: Any, clock: list[float]) -> None:
        self.inner, self.clock, self.name = inner, clock, inner.name

    def select(self, *args: Any) -> Any:
        start = time.perf_counter()
        out = self.inner.select(*args)
        self.clock[0] += time.perf_counter() - start
        return out


def skew(ids: torch.Tensor, share: float) -> torch.Tensor:
    """``ids`` ([T, k]) with the first choice of a fixed ``share`` of tokens (by position)
    replaced by expert 0 (its old first choice moves to second when that was expert 0)."""
    t = torch.arange(ids.shape[0], device=ids.device)
    hot = (t * 7919 % 100) < int(share * 100)
    first, second = ids[:, 0], ids[:, 1]
    new_second = torch.where(hot & (second == 0), first, second)
    return torch.stack([torch.where(hot, torch.zeros_like(first), first), new_second, *ids[:, 2:].unbind(1)], 1)


class _Hooks:
    """worker_setup for the inline engine: skew the gates, time the selectors (the balancer
    installs them after this runs, so each layer wraps its selector on its first forward)."""

    def __init__(self, share: float) -> None:
        self.share, self.clock = share, [0.0]

    def __call__(self, runner: Any) -> None:
        for module in runner.model.modules():
            if isinstance(module, MoELayer):
                module.gate.register_forward_hook(self._skew)
                module.register_forward_pre_hook(self._wrap)

    def _skew(self, module: Any, args: Any, out: Routing) -> Routing:
        return Routing(skew(out.expert_ids, self.share), out.weights)

    def _wrap(self, layer: Any, args: Any) -> None:
        table = layer.replicas
        if table is not None and not isinstance(table.selector, _Timed):
            table.selector = _Timed(table.selector, self.clock)


def run(dispatch: str, args: argparse.Namespace) -> dict[str, Any]:
    """One inline run; per decode step its wall time and the selectors' time (seconds)."""
    hooks = _Hooks(args.skew)
    eplb = {"window": 8, "interval": args.interval, "num_redundant": args.ranks, "num_gpus": args.ranks,
            "policy": "deepseek", "dispatch": dispatch}
    engine = build_engine(eplb=eplb, max_num_batched_tokens=args.batch_tokens, worker_setup=hooks)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    steps: list[float] = []
    select: list[float] = []
    outs = {}
    try:
        ids = [engine.add_request(None, list(range(3 * i, 3 * i + 24)), params) for i in range(args.requests)]
        while engine.has_unfinished_requests():
            hooks.clock[0] = 0.0
            start = time.perf_counter()
            for o in engine.step():
                outs[o.request_id] = o
            steps.append(time.perf_counter() - start)
            select.append(hooks.clock[0])
        for o in engine.flush():
            outs[o.request_id] = o
    finally:
        engine.close()
    decode = slice(2, None)  # the prefill round (and the one after it) excluded
    return {"steps": steps[decode], "select": select[decode],
            "tokens": [outs[i].outputs[0].token_ids for i in ids]}


def main(args: argparse.Namespace) -> None:
    """Print, per selector, the median decode step, the median selector time per step, its
    share of that step, the time it adds over the static selector as a share of the static
    run's step, and the step against static, all from the same invocation."""
    torch.set_num_threads(args.threads)
    order = ("static", "even", "balanced")
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in order}
    for rep in range(args.repeats):  # alternate the order: a loaded machine drifts
        for dispatch in order if rep % 2 == 0 else order[::-1]:
            runs[dispatch].append(run(dispatch, args))
    print(f"selector cost: inline tiny MoE, {args.ranks} virtual GPUs, {args.requests} requests decoding, "
          f"skew {args.skew}, {args.threads} thread(s), {args.repeats} runs per selector (medians over steps)")
    print(f"{'dispatch':<10}{'step ms':>9}{'select ms/step':>16}{'select / step':>15}"
          f"{'extra / static step':>21}{'step / static':>15}")
    base = statistics.median(s for m in runs["static"] for s in m["steps"])
    base_select = statistics.median(s for m in runs["static"] for s in m["select"])
    for name in order:
        steps = [s for m in runs[name] for s in m["steps"]]
        select = [s for m in runs[name] for s in m["select"]]
        step, sel = statistics.median(steps), statistics.median(select)
        print(f"{name:<10}{step * 1e3:>9.2f}{sel * 1e3:>16.3f}{100 * sel / step:>14.2f}%"
              f"{100 * (sel - base_select) / base:>20.2f}%{step / base:>15.3f}")
    same = all(m["tokens"] == runs["static"][0]["tokens"] for n in order for m in runs[n])
    print(f"greedy tokens identical across selectors: {same}")
