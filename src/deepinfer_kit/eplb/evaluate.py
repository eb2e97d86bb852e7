"""Judging placements: balancedness on a window, replicas moved, next-window score over a trace.

Shape symbols: ``L`` layers, ``E`` logical experts, ``P`` physical slots, ``G`` GPUs,
``T`` windows in a trace.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from deepinfer_kit.eplb.placement_ops import gpu_loads
from deepinfer_kit.eplb.protocols import PlacementPolicy
from deepinfer_kit.eplb.records import Placement, Topology
from deepinfer_kit.eplb.steps import check_steps
from deepinfer_kit.errors import ConfigError

__all__ = [
    "Evaluation", "TraceScore", "balancedness", "step_balancedness", "replicas_moved", "evaluate",
    "next_window_score",
]


@attrs.frozen(slots=True, eq=False)
class Evaluation:
    """How one placement fares on one window of load.

    Attributes:
        balancedness: ``[L]`` float64, mean GPU load / max GPU load per layer (1 is
            perfect; a layer with no load scores 1).
        gpu_load: ``[L, G]`` float64 load per GPU.
        replicas_moved: slots whose expert differs from the ``previous`` placement's (0
            when there is none).
    """

    balancedness: torch.Tensor
    gpu_load: torch.Tensor
    replicas_moved: int

    @property
    def mean(self) -> float:
        """Balancedness averaged over layers."""
        return float(self.balancedness.mean())


@attrs.frozen(slots=True, eq=False)
class TraceScore:
    """A policy replayed over a trace: plan on window ``t``, judged on window ``t + 1``.

    Attributes:
        policy: ``[T - 1]`` float64 layer-mean next-window balancedness of the policy.
        oracle: ``[T - 1]`` float64 the same when the oracle (DeepSeek's hierarchical or
            global policy, or the given one) plans from window ``t + 1`` itself.
        moved: ``[T - 1]`` int64 replicas moved by each rebalance (the first is 0).
    """

    policy: torch.Tensor
    oracle: torch.Tensor
    moved: torch.Tensor

    @property
    def mean(self) -> float:
        """Mean next-window balancedness of the policy."""
        return float(self.policy.mean())

    @property
    def oracle_mean(self) -> float:
        """Mean balancedness of the oracle (the upper bound reached with perfect foresight)."""
        return float(self.oracle.mean())


def balancedness(gpu_load: torch.Tensor) -> torch.Tensor:
    """``[...]`` float64 mean / max of ``gpu_load`` (``[..., G]``) over its last dim; 1 where
    a layer (or step) is idle."""
    g = gpu_load.double()
    top = g.max(dim=-1).values
    return torch.where(top > 0, g.mean(dim=-1) / top.clamp_min(1e-300), torch.ones_like(top))


def step_balancedness(placement: Placement, load: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """``[S, L]`` float64 balancedness of every step of a window (``load``: ``[S, L, E]``
    per-step counts) under ``placement``, each expert's count of the step split evenly
    over its replicas. What a per-step judge (the balancer's keep rule,
    :class:`~deepinfer_kit.eplb.movement.MovementAwarePlacementPolicy`'s tolerance)
    averages; for a one-step window it is :func:`evaluate`'s balancedness.

    Raises:
        ConfigError: ``load`` is not ``[S, L, E]`` with ``placement``'s ``L`` and ``E``.
    """
    check_steps(load)
    if tuple(load.shape[1:]) != tuple(placement.logcnt.shape):
        raise ConfigError(
            f"load must have shape [S, {', '.join(map(str, placement.logcnt.shape))}], got {tuple(load.shape)}"
        )
    return balancedness(gpu_loads(placement, load, num_gpus))


def replicas_moved(before: Placement, after: Placement) -> int:
    """Slots whose logical expert changes between two placements of the same shape.

    Raises:
        ConfigError: the ``phy2log`` shapes differ.
    """
    if before.phy2log.shape != after.phy2log.shape:
        raise ConfigError(
            f"placements must have the same phy2log shape, got {tuple(before.phy2log.shape)} "
            f"and {tuple(after.phy2log.shape)}"
        )
    return int((before.phy2log != after.phy2log).sum())


def evaluate(
    placement: Placement, load: torch.Tensor, num_gpus: int, previous: Placement | None = None
) -> Evaluation:
    """Score ``placement`` on ``load`` (``[L, E]``, CPU): an expert's load is split evenly
    over its replicas (the dispatcher round-robins copies over replicas).

    Args:
        placement: what to judge.
        load: ``[L, E]`` load of the window to judge on (usually the next one).
        num_gpus: ``G``, dividing ``P``.
        previous: the placement before; sets ``replicas_moved``.

    Raises:
        ConfigError: ``load``'s shape does not match ``placement.logcnt``.
    """
    if tuple(load.shape) != tuple(placement.logcnt.shape):
        raise ConfigError(
            f"load must have shape {tuple(placement.logcnt.shape)}, got {tuple(load.shape)}"
        )
    per_gpu = gpu_loads(placement, load, num_gpus)
    moved = 0 if previous is None else replicas_moved(previous, placement)
    return Evaluation(balancedness=balancedness(per_gpu), gpu_load=per_gpu, replicas_moved=moved)


def next_window_score(
    policy: PlacementPolicy,
    trace: Sequence[torch.Tensor],
    topology: Topology,
    oracle: PlacementPolicy | None = None,
) -> TraceScore:
    """Replay ``policy`` over ``trace`` (``T`` windows, oldest first: each ``[S, L, E]``
    per-step counts, or ``[L, E]`` for a window of one step).

    The policy is called once per window in order (a stateful policy sees the history it
    would see live); its placement from window ``t`` is judged on window ``t + 1``'s
    total. The oracle places from window ``t + 1`` itself.

    Args:
        policy: the policy under test (mutated if it keeps state).
        trace: at least 2 windows.
        topology: the cluster.
        oracle: the policy used with foresight; default DeepSeek's hierarchical policy.

    Raises:
        ConfigError: fewer than 2 windows, or a window that is neither ``[L, E]`` nor
            ``[S, L, E]``.
    """
    if len(trace) < 2:
        raise ConfigError(f"trace must hold at least 2 windows, got {len(trace)}")
    if oracle is None:
        from deepinfer_kit.eplb.deepseek import HierarchicalPlacementPolicy

        oracle = HierarchicalPlacementPolicy()
    gpus = topology.num_gpus
    windows = [w[None] if isinstance(w, torch.Tensor) and w.dim() == 2 else w for w in trace]
    ours, best, moved = [], [], []
    previous: Placement | None = None
    for t in range(len(windows) - 1):
        placement = policy.place(windows[t], topology)
        judged = check_steps(windows[t + 1], "trace window").sum(dim=0)
        ours.append(evaluate(placement, judged, gpus).mean)
        best.append(evaluate(oracle.place(windows[t + 1], topology), judged, gpus).mean)
        moved.append(0 if previous is None else replicas_moved(previous, placement))
        previous = placement
    return TraceScore(
        policy=torch.tensor(ours, dtype=torch.float64),
        oracle=torch.tensor(best, dtype=torch.float64),
        moved=torch.tensor(moved, dtype=torch.int64),
    )
