"""EplbView: the live-EPLB part of a trace step — placement, slot and GPU loads (before and after replica selection), rebalances."""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer_kit.engine.protocols import Balancer
from deepinfer_kit.viewer.schema import EplbMeta, EplbStepDoc, RebalanceDoc

__all__ = ["EplbView", "even_split"]


class EplbView:
    """Reads a :class:`~deepinfer_kit.engine.protocols.Balancer` after each committed step (for the recorder).

    The engine commits every step in flight before it rebalances, so when a step's trace
    arrives the balancer's placement is the one that step's forward ran under, and a
    record new in :attr:`ExpertBalancer.history` since the previous step is a rebalance
    that ran just before this step.

    Args:
        balancer: the engine's balancer (read only).
    """

    def __init__(self, balancer: Balancer) -> None:
        self._balancer = balancer
        self._seen = len(balancer.history)
        self._placement: list[list[int]] = balancer.placement.phy2log.tolist()

    def meta(self) -> EplbMeta:
        """The run's fixed EPLB facts (``meta.eplb``). Pure."""
        topology, config = self._balancer.topology, self._balancer.config
        return {"num_experts": self._balancer.num_experts, "num_slots": topology.num_physical_experts,
                "num_gpus": topology.num_gpus, "interval": config.interval, "window": config.window,
                "dispatch": config.dispatch}

    def step(self, slot_counts: tuple[tuple[int, ...], ...] | None,
             expert_counts: tuple[tuple[int, ...], ...] | None = None) -> EplbStepDoc:
        """The ``eplb`` entry of a step whose trace carried ``slot_counts`` (``[L][P]``,
        zeros when None) and ``expert_counts`` (``[L][E]`` routed copies; the per-GPU load
        before selection splits them evenly over each expert's replicas, zeros when either
        is None). Advances the view past the balancer's new history records."""
        phy2log: list[list[int]] = self._balancer.placement.phy2log.tolist()
        slots = ([list(row) for row in slot_counts] if slot_counts is not None
                 else [[0] * len(row) for row in phy2log])
        per_gpu = len(phy2log[0]) // self._balancer.topology.num_gpus if phy2log else 1
        loads = [[sum(row[g:g + per_gpu]) for g in range(0, len(row), per_gpu)] for row in slots]
        routed = (expert_counts if expert_counts is not None and slot_counts is not None
                  else [[0] * self._balancer.num_experts for _ in phy2log])
        even = [even_split(row, counts) for row, counts in zip(phy2log, routed)]
        before = [[sum(row[g:g + per_gpu]) for g in range(0, len(row), per_gpu)] for row in even]
        rebalance: RebalanceDoc | None = None
        history = self._balancer.history
        if len(history) > self._seen:
            record = history[-1]
            rebalance = {
                "after_step": record.after_step,
                "moved_slots": sum(r.moved_slots for r in history[self._seen:]),
                "balancedness_before": round(record.balancedness_before, 6),
                "balancedness_after": round(record.balancedness_after, 6),
                "before": [[round(x, 3) for x in row] for row in record.before.tolist()],
                "after": [[round(x, 3) for x in row] for row in record.after.tolist()],
                "changed": [[s for s, (a, b) in enumerate(zip(old, new)) if a != b]
                            for old, new in zip(self._placement, phy2log)],
            }
            self._seen = len(history)
        self._placement = phy2log
        return {"phy2log": phy2log, "slots": slots, "gpu_loads": loads, "gpu_loads_before": before,
                "rebalance": rebalance}


def even_split(phy2log: list[int], counts: Sequence[int]) -> list[int]:
    """Copies per slot (``P``) when each expert's ``counts[e]`` copies are split evenly over
    its slots in slot order (``c // n`` each, the first ``c % n`` one more: the rule of
    :class:`~deepinfer_kit.moe.selectors.EvenSelector`). Pure."""
    slots_of: dict[int, list[int]] = {}
    for s, e in enumerate(phy2log):
        slots_of.setdefault(e, []).append(s)
    out = [0] * len(phy2log)
    for e, slots in slots_of.items():
        share, extra = divmod(int(counts[e]), len(slots))
        for r, s in enumerate(slots):
            out[s] = share + (r < extra)
    return out
