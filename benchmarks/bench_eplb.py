"""EPLB policies judged on the next window of drifting, skewed expert load.

Each policy plans from window ``t`` of a drifting-Zipf trace
(:func:`deepinfer_kit.testing.eplb_traces.drifting_zipf_trace`) and is scored on window
``t + 1`` (balancedness = mean / max GPU load, averaged over layers and windows). The
oracle is DeepSeek's policy planning from window ``t + 1`` itself. Planning time is the
median and the fastest of single ``place`` calls on one CPU thread, timed alternately with
DeepSeek's policy ("x deepseek": fastest call over DeepSeek's fastest; the load average is
printed first, since the medians of a shared machine mean little).

    .venv/bin/python benchmarks/bench_eplb.py            # L=8, E=256, 8 groups, 4 nodes, 32 GPUs, 288 slots
    .venv/bin/python benchmarks/bench_eplb.py --quick    # tiny sizes, a second
    .venv/bin/python benchmarks/bench_eplb.py --batches  # per batch: placement x replica selector
                                                         # vs the exact LP, SGLang's lp and the oracle
                                                         # (benchmarks/eplb_batches.py)
    .venv/bin/python benchmarks/bench_eplb.py --steps    # per step of the next window: DeepInfer's
                                                         # policy, refine and peak, even and balanced
                                                         # dispatch, L=8 E=256 P=288 G=16 S=64
                                                         # (benchmarks/eplb_steps.py)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from deepinfer_kit.eplb import (
    ForecastPlacementPolicy,
    GlobalPlacementPolicy,
    HierarchicalPlacementPolicy,
    MovementAwarePlacementPolicy,
    Placement,
    PlacementPolicy,
    RefinedPlacementPolicy,
    Topology,
    next_window_score,
)
from deepinfer_kit.testing.eplb_traces import drifting_zipf_foresight, drifting_zipf_trace


def policies(mode: str) -> dict[str, Callable[[], PlacementPolicy]]:
    """Name -> factory of each policy for one mode (``hierarchical`` or ``global``)."""
    deepseek: Callable[[], PlacementPolicy] = (
        HierarchicalPlacementPolicy if mode == "hierarchical" else GlobalPlacementPolicy
    )
    m = "hierarchical" if mode == "hierarchical" else "global"
    return {
        "deepseek": deepseek,
        "refined": lambda: RefinedPlacementPolicy(m),  # type: ignore[arg-type]
        "forecast": lambda: ForecastPlacementPolicy(RefinedPlacementPolicy(m), decay=0.3),  # type: ignore[arg-type]
        "movement": lambda: MovementAwarePlacementPolicy(RefinedPlacementPolicy(m), expert_bytes=1),  # type: ignore[arg-type]
    }


class Foresight:
    """DeepSeek's policy planning, at window ``t``, from what a perfect forecaster would know
    (the hidden popularity carried one drift step forward, :func:`drifting_zipf_foresight`)
    instead of window ``t``: the most any forecast can gain. Benchmark-only (it reads the
    generator's hidden state)."""

    def __init__(self, inner: PlacementPolicy, ahead: list[torch.Tensor]) -> None:
        self._inner, self._ahead, self._calls = inner, ahead, 0

    def place(self, load: torch.Tensor, topology: Topology) -> Placement:
        """Plan from the foresight of the window ``load`` is (calls count the windows)."""
        self._calls += 1
        return self._inner.place(self._ahead[self._calls - 1][None], topology)


def plan_ms(
    factory: Callable[[], PlacementPolicy],
    baseline: Callable[[], PlacementPolicy],
    load: torch.Tensor,
    topology: Topology,
    repeat: int,
) -> tuple[float, float, float]:
    """Median and fastest milliseconds of one ``place`` call of the policy, and the ratio of
    its fastest call to ``baseline``'s (DeepSeek's), the two timed alternately. On a shared
    machine a call is often preempted for longer than it runs; the fastest of many calls is
    the one that ran undisturbed, so fastest-to-fastest is the stable comparison."""
    policy, base = factory(), baseline()
    policy.place(load, topology)
    base.place(load, topology)
    times: list[float] = []
    base_times: list[float] = []
    for _ in range(repeat):
        for planner, acc in ((base, base_times), (policy, times)):
            start = time.perf_counter()
            planner.place(load, topology)
            acc.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, min(times) * 1e3, min(times) / min(base_times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes")
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--exponent", type=float, default=0.8, help="Zipf exponent")
    parser.add_argument("--correlation", type=float, default=0.98)
    parser.add_argument("--tokens", type=int, default=1 << 17, help="routed tokens per layer per window")
    parser.add_argument("--repeat", type=int, default=101, help="timed calls per policy")
    parser.add_argument("--batches", action="store_true", help="the per-batch study of replica selectors")
    parser.add_argument("--batches-per-window", type=int, default=4)
    parser.add_argument("--steps", action="store_true", help="the per-step study against DeepInfer's policy")
    parser.add_argument("--deepinfer", default=None, help="the unpacked deepinfer 0.1.0 sdist (--steps)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.steps:
        from deepinfer_peer import find_sdist, load_eplb, missing  # beside this script
        from eplb_steps import run as run_steps

        root = find_sdist(args.deepinfer)
        peer = load_eplb(root) if root is not None else None
        note = missing(args.deepinfer) if root is None else None
        if args.quick:
            run_steps(2, 16, Topology(24, 1, 1, 4), 8, 3, 1, 256, 0.6, 3, peer, note)
        else:
            run_steps(8, 256, Topology(288, 1, 1, 16), 64, 4, args.seeds, 4096, 0.6, args.repeat, peer, note)
        return
    if args.batches:
        from eplb_batches import run  # beside this script

        quick = args.quick
        run(2 if quick else 8, 16 if quick else 256, Topology(24, 4, 2, 4) if quick else Topology(288, 8, 4, 32),
            3 if quick else 5, 2 if quick else 8, 1 if quick else args.batches_per_window, args.exponent,
            args.correlation, args.tokens, 0)
        return
    if args.quick:
        layers, experts, topology, args.windows, args.seeds, args.repeat = 2, 16, Topology(24, 4, 2, 4), 4, 1, 3
    else:
        layers, experts, topology = 8, 256, Topology(288, 8, 4, 32)
    print(f"L={layers} E={experts} {topology} windows={args.windows} seeds={args.seeds} "
          f"zipf={args.exponent} corr={args.correlation} tokens={args.tokens} "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(f"{'mode':<13}{'policy':<10}{'next-window':>12}{'oracle':>9}{'gap':>8}{'vs deepseek':>13}{'plan ms':>9}"
          f"{'fastest':>9}{'x deepseek':>12}")
    for mode in ("hierarchical", "global"):
        table = policies(mode)
        oracle_factory = table["deepseek"]
        scores: dict[str, float] = {}
        oracle = 0.0
        for name, factory in table.items():
            got = []
            for seed in range(args.seeds):
                trace = drifting_zipf_trace(args.windows, layers, experts, exponent=args.exponent,
                                            correlation=args.correlation, tokens_per_window=args.tokens, seed=seed)
                score = next_window_score(factory(), trace, topology, oracle=oracle_factory())
                got.append(score.mean)
                oracle += score.oracle_mean / (args.seeds * len(table))
            scores[name] = statistics.fmean(got)
        seen = []
        for seed in range(args.seeds):
            trace, ahead = (make(args.windows, layers, experts, exponent=args.exponent, correlation=args.correlation,
                                 tokens_per_window=args.tokens, seed=seed)
                            for make in (drifting_zipf_trace, drifting_zipf_foresight))
            seen.append(next_window_score(Foresight(oracle_factory(), ahead), trace, topology, oracle_factory()).mean)
        foresight = statistics.fmean(seen)
        load = drifting_zipf_trace(1, layers, experts, exponent=args.exponent, tokens_per_window=args.tokens)[0][None]
        for name, factory in table.items():
            ms, fastest, ratio = plan_ms(factory, oracle_factory, load, topology, args.repeat)
            print(f"{mode:<13}{name:<10}{scores[name]:>12.4f}{oracle:>9.4f}{oracle - scores[name]:>8.4f}"
                  f"{scores[name] - scores['deepseek']:>+13.4f}{ms:>9.2f}{fastest:>9.2f}{ratio:>12.2f}")
        print(f"{mode:<13}{'foresight':<10}{foresight:>12.4f}{oracle:>9.4f}{oracle - foresight:>8.4f}"
              f"{foresight - scores['deepseek']:>+13.4f}{'-':>9}{'-':>9}{'-':>12}")


if __name__ == "__main__":
    main()
