"""ReplicaLayout: one layer's slot map as the device tensors a ReplicaSelector reads.

Shape symbols: ``E`` logical experts, ``P`` physical slots, ``G`` GPUs the slots are split
over (``P / G`` consecutive slots each), ``R = P - E + 1`` most replicas of one expert,
``X = min(E, P - E)`` most experts with more than one replica (padded rows beyond the real
ones), ``W`` ranks, ``N`` routed copies on this rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from deepinfer_kit.errors import ConfigError

if TYPE_CHECKING:
    from deepinfer_kit.moe.selector_tables import SelectorTables

__all__ = ["ReplicaLayout", "Selection"]


@attrs.frozen(slots=True, eq=False)
class Selection:
    """What a :class:`~deepinfer_kit.moe.protocols.ReplicaSelector` decided for one rank.

    Attributes:
        slots: ``[N]`` int64, the physical slot of each routed copy (on the ids' device).
        sent: ``[P]`` int64, the copies this rank sends to each slot, as the selector
            reports them (computed from its plan, not counted from ``slots``).
        quotas: ``[P]`` int64, the copies every rank together sends to each slot (the same
            on every rank: a function of the all-gathered counts), or ``None`` for a rule
            that decides per copy without a whole-batch plan (static).
    """

    slots: torch.Tensor
    sent: torch.Tensor
    quotas: torch.Tensor | None


class ReplicaLayout:
    """The slot map ``phy2log`` of one layer, laid out for replica selection.

    Built on the host when a placement is applied (never inside a forward); every tensor
    has a shape fixed by ``E``, ``P`` and ``G`` alone, so a selection over it has no
    data-dependent shapes or Python branches.

    Args:
        phy2log: ``P`` ints, the logical expert of each slot (every expert at least once).
        num_experts: ``E``.
        num_gpus: ``G``, dividing ``P`` (virtual GPUs on one device; ranks in expert
            parallelism).
        device: where the tensors live.
        fixed: the :class:`SelectorTables` built from it keep their shapes whatever the
            slot map (the replicated experts padded to ``X`` rows, the water level by
            subsets exactly when ``R <= SUBSET_REACH``), so :meth:`update` rewrites them
            in place and a captured graph stays valid across rebalances.

    Raises:
        ConfigError: an id outside ``[0, E)``, an expert without a slot, or ``G`` not
            dividing ``P``.

    Attributes:
        phy2log: ``[P]`` int64. slot_gpu: ``[P]`` int64, ``s // (P / G)``.
        log2phy: ``[E, R]`` int64, each expert's slots in slot order, padded with its first.
        logcnt: ``[E]`` int64, replicas per expert.
        valid: ``[E, R]`` bool, ``r < logcnt[e]``.
        spread: ``[X]`` int64, the experts with more than one replica (padded with ``E``,
            a row past the experts); ``spread_valid``: ``[X]`` bool, which rows are real.
        num_spread: how many rows of ``spread`` are real (a host int, fixed by the slot map).
        spread_gpu: ``[X, R]`` int64, the GPU of each replica of each ``spread`` expert;
            ``G`` (a sentinel) for padding and for a second replica on a GPU already listed.
        tables: the count-based selectors' :class:`SelectorTables` of this layout, once
            :func:`~deepinfer_kit.moe.selector_tables.tables_of` built them (kept current
            by :meth:`update`); ``None`` before.
        spread_reach: host int, 1 + the last position of ``spread_gpu``'s real rows that
            holds a GPU other than the sentinel (0 without replicated experts).
        single_gpu: ``[E]`` int64, the GPU of each expert's first replica.
    """

    def __init__(self, phy2log: Sequence[int], num_experts: int, num_gpus: int,
                 device: torch.device | str | None = None, *, fixed: bool = False) -> None:
        self.num_experts, self.num_slots, self.num_gpus = num_experts, len(phy2log), num_gpus
        self.fixed = fixed
        self.tables: SelectorTables | None = None  # set by selector_tables.tables_of
        host = self._host_rows(phy2log)
        self.width = self.num_slots - num_experts + 1
        self.max_spread = max(min(num_experts, self.num_slots - num_experts), 1)

        def t(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        self.phy2log, self.slot_gpu, self.log2phy = t(host["phy2log"]), t(host["slot_gpu"]), t(host["log2phy"])
        self.logcnt, self.spread, self.spread_gpu = t(host["logcnt"]), t(host["spread"]), t(host["spread_gpu"])
        self.single_gpu = t(host["single_gpu"])
        self.valid = torch.arange(self.width, device=device)[None, :] < self.logcnt[:, None]
        self.spread_valid = torch.tensor(host["spread_valid"], dtype=torch.bool, device=device)

    def _host_rows(self, phy2log: Sequence[int]) -> dict[str, Any]:
        """The tables of ``phy2log`` as host lists (and :attr:`num_spread`,
        :attr:`spread_reach` set). Raises ConfigError as the constructor."""
        num_experts, num_gpus = self.num_experts, self.num_gpus
        slots = [int(e) for e in phy2log]
        count = len(slots)
        if count != self.num_slots:
            raise ConfigError(f"phy2log must hold {self.num_slots} slots, got {count}")
        if num_gpus < 1 or count % num_gpus:
            raise ConfigError(f"num_gpus must divide the {count} slots, got {num_gpus}")
        if any(not 0 <= e < num_experts for e in slots):
            raise ConfigError(f"phy2log entries must be in [0, {num_experts}), got {slots}")
        replicas: list[list[int]] = [[] for _ in range(num_experts)]
        for s, e in enumerate(slots):
            replicas[e].append(s)
        missing = [e for e, r in enumerate(replicas) if not r]
        if missing:
            raise ConfigError(f"phy2log must give every expert a slot, got none for {missing}")
        width = count - num_experts + 1
        max_spread = max(min(num_experts, count - num_experts), 1)
        per_gpu = count // num_gpus
        hot = [e for e, r in enumerate(replicas) if len(r) > 1]
        spread_gpu = []
        for e in hot:
            seen: list[int] = []
            for s in replicas[e]:
                g = s // per_gpu
                seen.append(g if g not in seen else num_gpus)
            spread_gpu.append(seen + [num_gpus] * (width - len(seen)))
        self.spread_reach = max((1 + max(r for r, g in enumerate(row) if g < num_gpus) for row in spread_gpu),
                                default=0)
        self.num_spread = len(hot)
        pad = max_spread - len(hot)
        return {
            "phy2log": slots, "slot_gpu": [s // per_gpu for s in range(count)],
            "log2phy": [r + [r[0]] * (width - len(r)) for r in replicas], "logcnt": [len(r) for r in replicas],
            "spread": hot + [num_experts] * pad, "spread_valid": [True] * len(hot) + [False] * pad,
            "spread_gpu": spread_gpu + [[0] + [num_gpus] * (width - 1)] * pad,
            "single_gpu": [r[0] // per_gpu for r in replicas],
        }

    def update(self, phy2log: Sequence[int]) -> None:
        """Take the slot map ``phy2log`` (same ``E``, ``P``, ``G``) by writing every tensor
        in place, and the :class:`SelectorTables` built from this layout too when it is
        :attr:`fixed` (else they are rebuilt at their next use): a CUDA graph captured
        over this layout keeps reading live tables. Call between forwards; host work and
        a few small copies. Raises ConfigError as the constructor (nothing changed)."""
        host = self._host_rows(phy2log)
        with torch.inference_mode():  # tensors a forward made (inference tensors) are written too
            self._write(host)

    def _write(self, host: dict[str, Any]) -> None:
        """:meth:`update`'s in-place writes (see there)."""
        for name in ("phy2log", "slot_gpu", "log2phy", "logcnt", "spread", "spread_gpu", "single_gpu",
                     "spread_valid"):
            target: torch.Tensor = getattr(self, name)
            target.copy_(torch.tensor(host[name], dtype=target.dtype))
        torch.lt(torch.arange(self.width, device=self.device)[None, :], self.logcnt[:, None], out=self.valid)
        if self.tables is not None:
            if self.fixed:
                self.tables.refresh()
            else:
                self.tables = None

    @property
    def device(self) -> torch.device:
        """Where the layout's tensors live."""
        return self.phy2log.device
