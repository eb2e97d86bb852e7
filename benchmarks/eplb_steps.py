"""Per-step study of bench_eplb.py (``--steps``): placements planned from a window's per-step
counts, judged on every step of the next window, side by side with DeepInfer's policy.

For each kind of window (:func:`deepinfer_kit.testing.eplb_traces.step_windows`:
stationary, drifting, bursty, prefill / decode alternation) every placement is planned from
window ``t`` and each step of window ``t + 1`` is one batch: its balancedness is mean / max
GPU load of that step, averaged over steps, layers and the judged windows. A placement is
judged under the dispatch that would run it (:mod:`deepinfer_kit.eplb.batch_study`):
``even`` (each expert's copies split equally over its replicas, what DeepInfer's and the
kit's sum policies plan for) and ``bal`` (the kit's BalancedSelector quotas, per step).

Rows: DeepInfer's ``rebalance_experts_global`` (loaded from its sdist by
``benchmarks/deepinfer_peer.py``; skipped with a line saying why when absent), the kit's
refined policy on the window's sum, and the peak policy (per-step, for balanced dispatch).
Planning time: fastest and median of single calls on one thread, the planners alternated.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from deepinfer_kit.eplb import PeakPlacementPolicy, Placement, RefinedPlacementPolicy, Topology, placement_from_phy2log
from deepinfer_kit.eplb.batch_study import even_split_balancedness, quota_balancedness
from deepinfer_kit.moe.selectors import BalancedSelector
from deepinfer_kit.testing.eplb_traces import STEP_KINDS, step_windows

Planner = Callable[[torch.Tensor], Placement]


def planners(topology: Topology, deepinfer: Callable[..., tuple[torch.Tensor, ...]] | None) -> dict[str, Planner]:
    """Name -> ``plan(window [S, L, E]) -> Placement`` of each compared policy."""
    slots, per_gpu = topology.num_physical_experts, topology.num_physical_experts // topology.num_gpus
    refine, peak = RefinedPlacementPolicy("global"), PeakPlacementPolicy("global")
    out: dict[str, Planner] = {}
    if deepinfer is not None:
        out["deepinfer"] = lambda w: placement_from_phy2log(deepinfer(w, slots, per_gpu)[0].long(), w.shape[2])
    out["refine"] = lambda w: refine.place(w, topology)
    out["peak"] = lambda w: peak.place(w, topology)
    return out


def plan_ms(plans: dict[str, Planner], window: torch.Tensor, repeat: int) -> dict[str, tuple[float, float]]:
    """Fastest and median milliseconds of one call of each planner, calls alternated."""
    for plan in plans.values():
        plan(window)
    times: dict[str, list[float]] = {name: [] for name in plans}
    for _ in range(repeat):
        for name, plan in plans.items():
            start = time.perf_counter()
            plan(window)
            times[name].append(time.perf_counter() - start)
    return {name: (min(t) * 1e3, statistics.median(t) * 1e3) for name, t in times.items()}


def run(layers: int, experts: int, topology: Topology, steps: int, windows: int, seeds: int, tokens: int,
        exponent: float, repeat: int, deepinfer: Callable[..., tuple[torch.Tensor, ...]] | None,
        missing: str | None) -> None:
    """Print one row per kind of window and the planning times."""
    plans = planners(topology, deepinfer)
    gpus, balanced = topology.num_gpus, BalancedSelector()
    print(f"per-step: L={layers} E={experts} P={topology.num_physical_experts} G={gpus} S={steps} "
          f"windows={windows} ({windows - 1} judged) x {seeds} seeds, tokens/step={tokens} k=8 zipf={exponent}")
    if missing:
        print(missing)
    short = {"deepinfer": "di"}
    cols = [f"{name}+{d}" for name in plans for d in ("even", "bal")]
    extra = ["peak+bal - di+even", "peak+bal - di+bal"] if "deepinfer" in plans else []
    print("di = DeepInfer's rebalance_experts_global; even / bal = the dispatch judged (even split / BalancedSelector)")
    print(f"{'window':<16}" + "".join(f"{short.get(c.split('+')[0], c.split('+')[0]) + '+' + c.split('+')[1]:>12}"
                                      for c in cols) + "".join(f"{c:>20}" for c in extra))
    for kind in STEP_KINDS:
        got: dict[str, list[float]] = {c: [] for c in cols}
        for seed in range(seeds):
            trace = step_windows(kind, windows, layers, experts, steps=steps, tokens=tokens, exponent=exponent,
                                 seed=seed)
            for t in range(windows - 1):
                for name, plan in plans.items():
                    placement = plan(trace[t])
                    got[f"{name}+even"].append(float(even_split_balancedness(trace[t + 1], placement, gpus).mean()))
                    got[f"{name}+bal"].append(float(quota_balancedness(trace[t + 1], placement, gpus, balanced).mean()))
        mean = {c: statistics.fmean(v) for c, v in got.items()}
        diffs = ([mean["peak+bal"] - mean["deepinfer+even"], mean["peak+bal"] - mean["deepinfer+bal"]]
                 if extra else [])
        print(f"{kind:<16}" + "".join(f"{mean[c]:>12.4f}" for c in cols) + "".join(f"{d:>+20.4f}" for d in diffs))
    window = step_windows("bursty", 1, layers, experts, steps=steps, tokens=tokens, exponent=exponent, seed=99)[0]
    ms = plan_ms(plans, window, repeat)
    line = "  ".join(f"{name} {fast:.2f} / {med:.2f}" for name, (fast, med) in ms.items())
    print(f"plan ms per call, fastest / median of {repeat}, one thread: {line}")
    if "deepinfer" in ms:
        print(f"peak / deepinfer planning time (fastest): {ms['peak'][0] / ms['deepinfer'][0]:.2f}x")
