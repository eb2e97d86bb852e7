"""ExpertSim: a simulated MoE model's expert loads, the real PlacementPolicy rebalancing
them, balancedness metrics, and the step-time penalty of imbalance.

Shape symbols: ``L`` MoE layers, ``E`` experts, ``P`` physical slots, ``G`` GPUs.
"""

from __future__ import annotations

import numpy as np
import torch

from deepinfer_kit.eplb.config import EplbConfig
from deepinfer_kit.eplb.deepseek import HierarchicalPlacementPolicy
from deepinfer_kit.eplb.evaluate import evaluate, replicas_moved
from deepinfer_kit.eplb.named import make_policy
from deepinfer_kit.eplb.protocols import PlacementPolicy
from deepinfer_kit.eplb.records import Placement, Topology
from deepinfer_kit.eplb.window import LoadWindow
from deepinfer_kit.sim.expert_records import ExpertReport, ExpertRouting
from deepinfer_kit.sim.router import SyntheticRouter

__all__ = ["ExpertSim", "step_balancedness"]


def step_balancedness(counts: np.ndarray, phy2log: np.ndarray, logcnt: np.ndarray,
                      num_gpus: int) -> np.ndarray:
    """``[L]`` mean / max GPU load of one step's ``counts`` (``[L, E]``) under a placement
    given as ``phy2log`` (``[L, P]``) and ``logcnt`` (``[L, E]``): each expert's count
    split evenly over its replicas, as :func:`deepinfer_kit.eplb.evaluate` does; 1 for an
    idle layer. Pure numpy; O(L * P)."""
    per_replica = counts / logcnt
    slot = np.take_along_axis(per_replica, phy2log, axis=1)
    gpu = slot.reshape(slot.shape[0], num_gpus, -1).sum(axis=2)
    top = gpu.max(axis=1)
    return np.where(top > 0, gpu.mean(axis=1) / np.maximum(top, 1e-300), 1.0)


class ExpertSim:
    """Routes every simulated step, keeps a :class:`LoadWindow` of the counts, and every
    ``eplb.interval`` steps asks the real policy ``eplb.policy`` names for a placement of
    the window's per-step counts, used as is (``policy.place(window.steps(), topology)``).

    Before the first plan the placement is the one DeepSeek's policy makes of a uniform
    load (as the engine's balancer starts). The step-time model: a round of duration
    ``t`` under per-layer balancedness ``b_l`` takes ``t * (1 - f + f * mean_l(1 / b_l))``
    (``f = routing.moe_fraction``: each layer's expert part waits for its most loaded GPU,
    ``max / mean = 1 / b_l`` times the balanced time).

    Args:
        eplb: window, interval, policy and topology.
        routing: the MoE shape and router.
        expert_bytes: one expert's weight bytes (reported by the ``movement`` policy).
        policy: the placement policy (``Components.placement_policy``); default the one
            ``eplb.policy`` names.

    Raises:
        ConfigError: a topology the slots do not divide over (naming the eplb field).
    """

    def __init__(self, eplb: EplbConfig, routing: ExpertRouting, expert_bytes: int = 0, *,
                 policy: PlacementPolicy | None = None) -> None:
        L, E = routing.num_layers, routing.num_experts
        self.eplb = eplb
        self.routing = routing
        self.topology: Topology = eplb.topology(E, 1)
        self.policy: PlacementPolicy = policy if policy is not None else make_policy(eplb, expert_bytes)
        self.oracle = HierarchicalPlacementPolicy()
        self.router = SyntheticRouter(L, E, routing.top_k, exponent=routing.exponent,
                                      correlation=routing.correlation,
                                      drift_every=routing.drift_every, seed=routing.seed)
        self.window = LoadWindow(L, E, eplb.window)
        uniform = torch.ones(1, L, E, dtype=torch.int64)
        self.placement: Placement = self.oracle.place(uniform, self.topology)
        self._use(self.placement)
        self._since = np.zeros((L, E), dtype=np.int64)
        self._steps_since = 0
        self.num_steps = 0
        self.rebalances = 0
        self.replicas_moved = 0
        self._bal: list[np.ndarray] = []
        self._oracle: list[np.ndarray] = []
        self._step_bal = 0.0
        self._slowdown = 0.0

    def _use(self, placement: Placement) -> None:
        self._phy2log = placement.phy2log.numpy()
        self._logcnt = placement.logcnt.numpy().astype(np.float64)

    def on_step(self, num_tokens: int, duration: float) -> float:
        """Route a round of ``num_tokens`` tokens, record its counts, and return its
        duration stretched by the imbalance of the placement in force. Then, when
        ``interval`` steps have run since the last plan, judge the interval and rebalance.
        Mutates the router, window, placement and metrics. Called once per round by
        :meth:`SimRunner.prepare`."""
        counts = self.router.route(num_tokens)
        b = step_balancedness(counts, self._phy2log, self._logcnt, self.topology.num_gpus)
        factor = 1.0 - self.routing.moe_fraction + self.routing.moe_fraction * float(np.mean(1.0 / b))
        self._step_bal += float(b.mean())
        self._slowdown += factor
        self.window.record(torch.from_numpy(counts))
        self._since += counts
        self._steps_since += 1
        self.num_steps += 1
        if self._steps_since >= self.eplb.interval:
            self._close_interval()
            new = self.policy.place(self.window.steps(), self.topology)
            self.replicas_moved += replicas_moved(self.placement, new)
            self.rebalances += 1
            self.placement = new
            self._use(new)
        return duration * factor

    def _close_interval(self) -> None:
        """Judge the placement in force and the oracle on the counts since the last plan."""
        load = torch.from_numpy(self._since.copy())
        gpus = self.topology.num_gpus
        self._bal.append(evaluate(self.placement, load, gpus).balancedness.numpy())
        self._oracle.append(evaluate(self.oracle.place(load[None], self.topology), load, gpus)
                            .balancedness.numpy())
        self._since[:] = 0
        self._steps_since = 0

    def report(self) -> ExpertReport:
        """The run's :class:`ExpertReport` (closes a partial last interval first; call once,
        after the run)."""
        if self._steps_since:
            self._close_interval()
        bal = np.concatenate(self._bal) if self._bal else np.ones(1)
        orc = np.concatenate(self._oracle) if self._oracle else np.ones(1)
        n = max(self.num_steps, 1)
        return ExpertReport(
            balance_mean=float(bal.mean()), balance_min=float(bal.min()),
            oracle_mean=float(orc.mean()), oracle_min=float(orc.min()),
            step_balance_mean=self._step_bal / n if self.num_steps else 1.0,
            slowdown_mean=self._slowdown / n if self.num_steps else 1.0,
            rebalances=self.rebalances, replicas_moved=self.replicas_moved,
        )
