"""Per-batch study of bench_eplb.py (``--batches``): placement x replica selector, judged on each batch.

A placement is planned by DeepSeek's policy from window ``t`` of a drifting-Zipf trace;
batches of 64 / 512 / 4,096 tokens (``k`` distinct experts each) are drawn from window
``t + 1``'s popularity and split over the replicas by each selector. Reported: the mean
over batches and layers of each batch's balancedness (mean / max GPU load), next to

- ``lp``: the exact linear program (scipy's HiGHS) over the same placement: the best any
  split of each batch can do (fractional, so an upper bound for integer splits);
- ``sglang-lp``: SGLang's LP dispatch when ``sglang`` is importable (``PYTHONPATH`` to a
  ``pip install --no-deps --target`` copy): its ``LPLBSolver`` builds the LP from the
  placement, the LP is solved exactly on the CPU and each copy is drawn to a replica by
  the resulting probabilities, as SGLang dispatches (:class:`SglangLP` says what runs
  where; SGLang's own solve runs only as CUDA kernels on a Hopper GPU);
- ``oracle``: DeepSeek's policy planning from the batch itself, split evenly.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from deepinfer_kit.eplb import GlobalPlacementPolicy, HierarchicalPlacementPolicy, PlacementPolicy, Topology
from deepinfer_kit.eplb.batch_study import batch_balancedness, even_split_balancedness, layouts_of, sample_batch
from deepinfer_kit.moe.protocols import ReplicaSelector
from deepinfer_kit.moe.replica_layout import ReplicaLayout
from deepinfer_kit.moe.selectors import BalancedSelector, EvenSelector, StaticSelector, gpu_load_of
from deepinfer_kit.testing.eplb_traces import drifting_zipf_trace

SIZES = (64, 512, 4096)


def lp_balancedness(counts: torch.Tensor, layout: ReplicaLayout) -> float | None:
    """Mean / max GPU load of the exact LP split of ``counts`` (``[E]``), or None without scipy."""
    try:
        from scipy.optimize import linprog  # type: ignore[import-untyped]
    except ImportError:
        return None
    gpus = layout.num_gpus
    c = counts.double()
    base = torch.zeros(gpus, dtype=torch.float64)
    single = layout.logcnt == 1
    base.index_add_(0, layout.single_gpu[single], c[single])
    pairs = [(e, int(layout.slot_gpu[layout.log2phy[e, r]])) for e in torch.nonzero(~single).flatten().tolist()
             for r in range(int(layout.logcnt[e]))]
    n = len(pairs)
    if n == 0:
        return float(base.mean() / base.max()) if float(base.max()) > 0 else 1.0
    experts = sorted({e for e, _ in pairs})
    a_eq = torch.zeros(len(experts), n + 1, dtype=torch.float64)
    for j, (e, _) in enumerate(pairs):
        a_eq[experts.index(e), j] = 1.0
    a_ub = torch.zeros(gpus, n + 1, dtype=torch.float64)
    for j, (_, g) in enumerate(pairs):
        a_ub[g, j] = 1.0
    a_ub[:, n] = -1.0
    cost = [0.0] * n + [1.0]
    res = linprog(cost, A_ub=a_ub.numpy(), b_ub=(-base).numpy(), A_eq=a_eq.numpy(),
                  b_eq=c[experts].numpy(), bounds=[(0, None)] * (n + 1), method="highs")
    return float(c.sum() / gpus / res.x[n])


class SglangLP:
    """SGLang's LP dispatch (``--ep-dispatch-algorithm lp``) for one layout, driven on the CPU.

    Built by SGLang's own ``LPLBSolver`` (its constraint matrices ``A``, cost ``c``, the
    single / replicated slot split) with its constructor's warm-up of the CUDA kernel
    skipped. Per batch, the three steps its ``_solve`` runs as JIT CUDA kernels are done
    here in torch, following ``lp_prep.cuh`` / ``lp_post.cuh`` / ``dispatch_probability.cuh``:
    counts normalised by the batch total into ``b`` and the Big-M column; the standard-form
    LP ``min c.x, A x = b, x >= 0`` solved by scipy's HiGHS (exactly, where SGLang runs 5
    barrier iterations of an interior-point method on a Hopper GPU); each copy's replica
    drawn by the resulting per-replica probabilities from seeded uniforms, as its dispatch
    kernel does. Raises ImportError without sglang or scipy.
    """

    def __init__(self, layout: ReplicaLayout) -> None:
        from scipy.optimize import linprog  # noqa: F401 - fail early
        from sglang.kernels.ops.lplb import torch_solver  # type: ignore[import-not-found]
        from sglang.srt.eplb.lplb_solver import LPLBSolver  # type: ignore[import-not-found]

        warmup = torch_solver.warmup
        torch_solver.warmup = lambda *args, **kwargs: None  # it compiles the CUDA kernel
        try:
            self.solver = LPLBSolver(layout.phy2log, torch.where(layout.valid, layout.log2phy, -1),
                                     layout.num_gpus, None, logical_to_all_physical_map_num_valid=layout.logcnt)
        finally:
            torch_solver.warmup = warmup
        self.layout = layout

    def probabilities(self, counts: torch.Tensor) -> torch.Tensor:
        """``[E, R]`` float32 ``log2phy_prob`` for ``counts`` (``[E]`` copies per expert)."""
        from scipy.optimize import linprog

        sv, counts = self.solver, counts.float()
        total = max(float(counts[sv.log_single].sum() + counts[sv.log_replicated].sum()), 1.0)
        t1 = counts[sv.log_single] / total
        b = torch.cat([counts[sv.log_replicated] / total, -(sv.B1 @ t1)])
        a = sv._A_full.clone()
        a[:, -1] = b - sv._A_base_row_sum
        res = linprog(sv.c_vec.double().numpy(), A_eq=a.double().numpy(), b_eq=b.double().numpy(),
                      bounds=(0, None), method="highs")
        x = torch.as_tensor(res.x, dtype=torch.float32)
        phy = torch.zeros(sv.num_phy + 1)
        phy[sv.phy_replicated] = x[: sv.num_red_phy].clamp(min=0)
        phy[sv.phy_single] = t1
        return phy[torch.where(sv.log2phy < 0, sv.num_phy, sv.log2phy)]

    def balancedness(self, ids: torch.Tensor, gen: torch.Generator) -> float:
        """Mean / max GPU load once the copies ``ids`` (``[N]``) are drawn to replicas."""
        layout = self.layout
        prob = self.probabilities(torch.bincount(ids, minlength=layout.num_experts))[ids]
        row = prob.sum(1, keepdim=True)
        prob = torch.where(row > 0, prob, layout.valid[ids].float())
        u = torch.rand(ids.numel(), generator=gen) * prob.sum(1)
        chosen = (u[:, None] >= prob.cumsum(1)).sum(1).clamp(max=layout.width - 1)
        load = gpu_load_of(torch.bincount(layout.log2phy[ids, chosen], minlength=layout.num_slots), layout)
        return float(load.float().mean() / load.max()) if int(load.max()) > 0 else 1.0


def run(layers: int, experts: int, topology: Topology, windows: int, top_k: int, batches: int,
        exponent: float, correlation: float, tokens: int, seed: int) -> None:
    """Print one table per mode: balancedness per batch size and selector."""
    selectors: dict[str, ReplicaSelector] = {"static": StaticSelector(), "even": EvenSelector(), "balanced-1": BalancedSelector(1),
                 "balanced": BalancedSelector()}
    gen = torch.Generator().manual_seed(seed)
    draws = torch.Generator().manual_seed(seed + 1)  # sglang-lp's uniforms: the batches stay those of a run without it
    sglang_note = ""
    print(f"per-batch: L={layers} E={experts} {topology} k={top_k} windows={windows} batches/window={batches}")
    print(f"{'mode':<13}{'tokens':>7}" + "".join(f"{n:>12}" for n in (*selectors, "lp", "sglang-lp", "oracle"))
          + f"{'bal-static':>12}{'bal/lp':>9}{'sel ms':>8}")
    for mode in ("hierarchical", "global"):
        make: Callable[[], PlacementPolicy] = (HierarchicalPlacementPolicy if mode == "hierarchical"
                                               else GlobalPlacementPolicy)
        trace = drifting_zipf_trace(windows, layers, experts, exponent=exponent, correlation=correlation,
                                    tokens_per_window=tokens, seed=seed)
        for size in SIZES:
            got: dict[str, list[float]] = {n: [] for n in (*selectors, "lp", "sglang-lp", "oracle")}
            spent = 0.0
            for t in range(windows - 1):
                placement = make().place(trace[t][None], topology)
                layouts = layouts_of(placement, topology.num_gpus)
                for _ in range(batches):
                    ids = sample_batch(trace[t + 1].double(), size, top_k, gen)
                    for name, selector in selectors.items():
                        start = time.perf_counter()
                        got[name].append(float(batch_balancedness(ids, layouts, selector).mean()))
                        spent += (time.perf_counter() - start) if name == "balanced" else 0.0
                    counts = torch.stack([torch.bincount(r, minlength=experts) for r in ids])
                    lps = [lp_balancedness(c, lay) for c, lay in zip(counts, layouts)]
                    if all(v is not None for v in lps):
                        got["lp"].append(statistics.fmean(v for v in lps if v is not None))
                    try:
                        got["sglang-lp"].append(statistics.fmean(
                            SglangLP(lay).balancedness(r, draws) for r, lay in zip(ids, layouts)))
                    except Exception as exc:  # noqa: BLE001 - reported once below
                        sglang_note = f"{type(exc).__name__}: {exc}"
                    oracle = make().place(counts[None], topology)
                    got["oracle"].append(float(even_split_balancedness(counts, oracle, topology.num_gpus).mean()))
            mean = {n: statistics.fmean(v) if v else float("nan") for n, v in got.items()}
            calls = (windows - 1) * batches * layers
            print(f"{mode:<13}{size:>7}" + "".join(f"{mean[n]:>12.4f}" for n in got)
                  + f"{mean['balanced'] - mean['static']:>+12.4f}{mean['balanced'] / mean['lp']:>9.4f}"
                  + f"{spent / calls * 1e3:>8.2f}")
    if sglang_note:
        print(f"sglang-lp: not run here ({sglang_note[:160]})")
