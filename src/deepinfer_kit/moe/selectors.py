"""Replica selectors: which replica of its expert serves each routed copy, decided per batch.

Shape symbols as in :mod:`deepinfer_kit.moe.replica_layout`: ``E`` experts, ``P`` slots,
``G`` GPUs, ``R`` most replicas of one expert, ``X`` experts with replicas (padded), ``W``
ranks, ``N`` this rank's routed copies.

Three implementations of :class:`~deepinfer_kit.moe.protocols.ReplicaSelector`:

- :class:`StaticSelector` — the fixed rule: copy ``i`` of the flat routing of rank ``w``
  goes to replica ``(i + w) % logcnt[e]`` (what the dispatchers always did);
- :class:`EvenSelector` — every expert's copies of the whole batch split over its replicas
  in equal shares (``c // n`` each, the first ``c % n`` replicas one more);
- :class:`BalancedSelector` — per batch, the shares that minimise the busiest GPU's load,
  by water-filling (below).

Count-based selectors (even, balanced) plan whole-batch quotas per slot from the
all-gathered ``[W, E]`` counts — identical on every rank — and then number the copies of
each expert over the ranks (rank order, then flat order): the copy numbered ``g`` goes to
the replica whose quota interval holds ``g``. Every rank thus dispatches its part of one
global plan, and the slots receive exactly the quotas.

**The balancer.** Minimise ``max_g load_g`` over shares ``x_{e,r} >= 0`` with
``sum_r x_{e,r} = c_e`` (an LP; an expert with one replica puts its ``c_e`` on its GPU).
The reachable GPU-load vectors form the base polytope of a polymatroid, whose
minimum-norm point minimises the maximum load (Fujishige 1980: it is lexicographically
optimal). :class:`BalancedSelector` finds it by block-coordinate descent on
``sum_g load_g^2``: for each replicated expert in turn (hottest first), take its shares off
and water-fill its ``c_e`` copies onto its replicas' GPUs given the others' loads (the
level ``h = min_k (c_e + sum_{i<=k} l_(i)) / k`` over the sorted loads ``l``, exact), for
``sweeps`` passes. The first pass alone is the greedy water-filling; every pass is exact
for its block, so the sum of squares falls monotonically to its minimum (the LP optimum
``OPT`` in the maximum) as the passes grow. Each call can certify its gap:
:func:`makespan_lower_bound` returns ``LB <= OPT`` (Hall's bound: the experts whose every
replica lies on the top ``j`` GPUs load them at least ``D_j / j``), tight at the optimum,
so ``max load - LB`` bounds the distance to the LP on every batch. Shares are rounded to
integers by rounding the cumulative shares of each expert: each replica's count is within
1 of its share, so a GPU gains at most one copy per replica it holds over the fractional
plan.

Every selector is device-side torch ops over shapes fixed by the layout: no host sync, no
data-dependent Python branch or loop (the passes run ``sweeps * X`` fixed steps), so it
can be captured in a CUDA graph; deterministic for a given batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.moe.counts import copies_per_id
from deepinfer_kit.moe.replica_layout import ReplicaLayout, Selection
from deepinfer_kit.moe.selector_tables import SelectorTables, assign, round_shares, tables_of, water_fill

if TYPE_CHECKING:
    from deepinfer_kit.moe.protocols import ReplicaSelector

__all__ = [
    "SELECTOR_NAMES", "StaticSelector", "EvenSelector", "BalancedSelector", "make_selector",
    "makespan_lower_bound", "gpu_load_of",
]

SELECTOR_NAMES = ("static", "even", "balanced")


def _check(ids: torch.Tensor, counts: torch.Tensor, rank: int, layout: ReplicaLayout) -> None:
    if ids.dim() != 1 or counts.dim() != 2 or counts.shape[1] != layout.num_experts:
        raise ConfigError(f"expert_ids must be [N] and counts [W, {layout.num_experts}], got "
                          f"{list(ids.shape)} and {list(counts.shape)}")
    if not 0 <= rank < counts.shape[0]:
        raise ConfigError(f"rank must be in [0, {counts.shape[0]}), got {rank}")


class StaticSelector:
    """The fixed rule: copy ``i`` of rank ``w``'s flat routing to replica ``(i + w) % logcnt``
    of its expert (a spread by position, blind to the batch's counts)."""

    name = "static"

    def select(self, expert_ids: torch.Tensor, counts: torch.Tensor, rank: int,
               layout: ReplicaLayout) -> Selection:
        """See :meth:`ReplicaSelector.select`; ``sent`` is counted from the slots, and
        ``quotas`` is ``None`` (no whole-batch plan)."""
        _check(expert_ids, counts, rank, layout)
        position = torch.arange(expert_ids.numel(), device=expert_ids.device) + rank
        slots = layout.log2phy[expert_ids, position % layout.logcnt[expert_ids]]
        return Selection(slots=slots, sent=copies_per_id(slots, layout.num_slots), quotas=None)


class _Tabled:
    """Reads the layout's :class:`SelectorTables` (the layout keeps them current)."""

    def tables(self, layout: ReplicaLayout) -> SelectorTables:
        """The tables of ``layout`` (built on first use; device ops only)."""
        return tables_of(layout)


class EvenSelector(_Tabled):
    """Each expert's copies of the whole batch in equal shares over its replicas."""

    name = "even"

    def _quotas(self, total: torch.Tensor, tables: SelectorTables) -> torch.Tensor:
        layout = tables.layout
        if layout.num_spread == 0:
            return round_shares(total, None, tables)
        n = layout.logcnt
        share = (total // n)[:, None] + (tables.replica[None, :] < (total % n)[:, None]).to(torch.int64)
        out = torch.zeros(layout.num_slots + 2, dtype=torch.int64, device=total.device)
        return out.index_add_(0, tables.slot_or_pad, (share * layout.valid).flatten())

    def quotas(self, total: torch.Tensor, layout: ReplicaLayout) -> torch.Tensor:
        """``[P]`` int64 copies per slot for ``total`` (``[E]`` whole-batch copies per expert)."""
        return self._quotas(total, self.tables(layout))[: layout.num_slots]

    def select(self, expert_ids: torch.Tensor, counts: torch.Tensor, rank: int,
               layout: ReplicaLayout) -> Selection:
        """See :meth:`ReplicaSelector.select`."""
        _check(expert_ids, counts, rank, layout)
        tables = self.tables(layout)
        return assign(expert_ids, counts, rank, tables, self._quotas(counts.sum(0), tables))


class BalancedSelector(_Tabled):
    """Per batch, shares that minimise the busiest GPU's load (water-filling, see the
    module docstring for the method and its bound).

    Its cost is a fixed number of small device ops set by the layout: none of the loop
    when no expert is replicated, one pass when one is, ``sweeps`` passes over the ``H``
    replicated experts otherwise (:mod:`deepinfer_kit.moe.selector_tables`).

    Args:
        sweeps: passes of block-coordinate water-filling (``>= 1``; 1 is the greedy).

    Raises:
        ConfigError: ``sweeps < 1``.
    """

    name = "balanced"

    def __init__(self, sweeps: int = 3) -> None:
        if isinstance(sweeps, bool) or not isinstance(sweeps, int) or sweeps < 1:
            raise ConfigError(f"sweeps must be an int >= 1, got {sweeps!r}")
        self.sweeps = sweeps

    def shares(self, total: torch.Tensor, layout: ReplicaLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """Fractional plan for ``total`` (``[E]`` copies per expert): ``([H, R]`` float64
        shares of the replicated experts' replicas, in ``layout.spread``'s row order,
        ``[G]`` float64 GPU loads)."""
        tables = self.tables(layout)
        load = torch.addmv(tables.sentinel, tables.fixed, total.to(torch.float64))
        if layout.num_spread == 0:
            return load.new_zeros(0, layout.width), load[: layout.num_gpus]
        shares = water_fill(total, tables, self.sweeps)
        load.index_add_(0, tables.hot_gpu.flatten(), shares.flatten())
        return shares, load[: layout.num_gpus]

    def _quotas(self, total: torch.Tensor, tables: SelectorTables) -> torch.Tensor:
        shares = water_fill(total, tables, self.sweeps) if tables.layout.num_spread else None
        return round_shares(total, shares, tables)

    def quotas(self, total: torch.Tensor, layout: ReplicaLayout) -> torch.Tensor:
        """``[P]`` int64 copies per slot: :meth:`shares` rounded by cumulative shares."""
        return self._quotas(total, self.tables(layout))[: layout.num_slots]

    def select(self, expert_ids: torch.Tensor, counts: torch.Tensor, rank: int,
               layout: ReplicaLayout) -> Selection:
        """See :meth:`ReplicaSelector.select`."""
        _check(expert_ids, counts, rank, layout)
        tables = self.tables(layout)
        return assign(expert_ids, counts, rank, tables, self._quotas(counts.sum(0), tables))


def make_selector(name: str) -> StaticSelector | EvenSelector | BalancedSelector:
    """The selector called ``name`` (one of :data:`SELECTOR_NAMES`).

    Raises:
        ConfigError: an unknown name (the message lists the known ones).
    """
    if name == "static":
        return StaticSelector()
    if name == "even":
        return EvenSelector()
    if name == "balanced":
        return BalancedSelector()
    raise ConfigError(f"eplb.dispatch must be one of {list(SELECTOR_NAMES)}, got {name!r}")


def gpu_load_of(slot_counts: torch.Tensor, layout: ReplicaLayout) -> torch.Tensor:
    """``[G]`` int64 copies per GPU from ``[P]`` copies per slot (same device)."""
    return slot_counts.view(layout.num_gpus, -1).sum(1)


def makespan_lower_bound(total: torch.Tensor, layout: ReplicaLayout, gpu_load: torch.Tensor) -> torch.Tensor:
    """A 0-dim float64 lower bound on the LP's busiest-GPU load for ``total`` (``[E]``):
    ``max_j D_j / j`` over the top-``j`` GPUs of ``gpu_load`` (``[G]``, any plan's loads),
    ``D_j`` the copies of the experts whose every replica lies on them (they can go nowhere
    else). Tight when ``gpu_load`` is the LP optimum's min-norm loads. Device ops only."""
    gpus = layout.num_gpus
    order = torch.argsort(gpu_load.to(torch.float64), descending=True, stable=True)
    position = torch.empty_like(order).scatter_(0, order, torch.arange(gpus, device=order.device))
    where = position[layout.slot_gpu[layout.log2phy]]  # [E, R], padding repeats the first slot
    last = where.max(1).values
    inside = torch.zeros(gpus, dtype=torch.float64, device=total.device)
    inside.index_add_(0, last, total.to(torch.float64))
    sizes = torch.arange(1, gpus + 1, dtype=torch.float64, device=total.device)
    return (torch.cumsum(inside, 0) / sizes).max()


if TYPE_CHECKING:
    _static: type[ReplicaSelector] = StaticSelector
    _even: type[ReplicaSelector] = EvenSelector
    _balanced: type[ReplicaSelector] = BalancedSelector
