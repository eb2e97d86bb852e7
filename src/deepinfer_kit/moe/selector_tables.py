"""The per-layout index tables and the per-batch steps the count-based replica selectors share.

A selector runs on every MoE layer of every step, on tensors of a few dozen elements, so
its cost is the number of torch ops it launches, not their size. Everything that depends
on the slot map alone is built once per layout (:class:`SelectorTables`, by device ops: no
host read) and reused; the per-batch steps below launch a fixed number of ops set by the
layout's host ints (``num_spread``), never by the batch's values.

Each replicated expert's water level ``h = min_k (c + sum of the k lowest loads) / k`` is
also ``min_S (c + sum_{g in S} load_g) / |S|`` over the nonempty sets ``S`` of its GPUs
(the ``k`` lowest are the best set of size ``k``). When every replicated expert's GPUs lie
within its first ``SUBSET_REACH`` replica positions, the level is one matrix-vector
product over those position subsets (:attr:`SelectorTables.subsets`) instead of a sort and
a prefix sum: three cheap ops instead of five, the sort the dearest of all on a CPU.

Shape symbols as in :mod:`deepinfer_kit.moe.replica_layout`, with ``H`` the experts that
have more than one replica (``layout.num_spread``) and ``M = 2^reach - 1`` subsets. Slot vectors are extended past ``P``
by two scratch entries: ``P``, always 0, where the padding of a replica row points, and
``P + 1``, where a replicated expert's count lands when the single-replica experts' counts
are scattered (never read).
"""

from __future__ import annotations

import torch

from deepinfer_kit.moe.counts import copies_per_id
from deepinfer_kit.moe.replica_layout import ReplicaLayout, Selection

__all__ = ["SelectorTables", "assign", "tables_of", "water_fill", "round_shares", "SUBSET_REACH"]

SUBSET_REACH = 6  # replica positions up to which the water level is taken over subsets (63)
FULL = 1e300  # the sentinel GPU's load: finite, so a 0 weight on it stays 0 in a product


class SelectorTables:
    """Index tables of one :class:`ReplicaLayout` for count-based selection.

    Built by device ops from the layout's tensors (same device; nothing read back); the
    layout's host ints size the loops, or, for a :attr:`ReplicaLayout.fixed` layout, its
    shape alone: ``H = X`` rows (padding rows: expert 0 with ``hot_weight`` 0, so no
    demand and no shares) and subsets exactly when ``R <= SUBSET_REACH``. Changed only by
    :meth:`refresh` (in place).

    Attributes:
        layout: the layout these tables describe (a selector rebuilds when it changes).
        slot_or_pad: ``[E * R]`` int64, each expert's replica slots, padding -> ``P``.
        single_slot: ``[E]`` int64, an expert's slot when it has one replica, else ``P + 1``.
        first_slot: ``[E]`` int64, each expert's first replica's slot.
        experts: ``[E]`` int64, ``0 .. E-1``.
        replica: ``[R]`` int64, ``0 .. R-1``.
        hot: ``[H]`` int64, the replicated experts (``layout.spread``'s real rows).
        hot_weight: ``[H]`` float64, 1 for a real row and 0 for padding (fixed layouts
            only; ``None`` otherwise).
        hot_gpu: ``[H, R]`` int64, their replicas' GPUs (``G``, an always-full sentinel, for
            padding and for a second replica on one GPU).
        hot_rows: the ``H`` rows of ``hot_gpu``.
        hot_slot: ``[H * R]`` int64, their replicas' slots (padding -> ``P``).
        hot_next: ``[H * R]`` int64, the slot of the next replica position (``P + 1`` past
            the last): rounding scatters each cumulative bound ``+`` at its slot and ``-``
            at the next, so the differences need no extra op.
        fixed: ``[G + 1, E]`` float64, ``1`` where a single-replica expert's GPU is.
        sentinel: ``[G + 1]`` float64, ``0`` but :data:`FULL` at ``G``.
        ranks: ``[R]`` float64, ``1 .. R``.
        subsets: ``[H, M, G + 1]`` float64 (or None past :data:`SUBSET_REACH`): row ``m``
            of expert ``h`` marks the GPUs of the replica positions in the bits of ``m + 1``
            (a set with the sentinel never wins the minimum).
        sizes: ``[M]`` float64, the size of each subset.
    """

    def __init__(self, layout: ReplicaLayout) -> None:
        self._build(layout)

    def refresh(self) -> None:
        """Rewrite every table in place from the layout's current tensors (a
        :attr:`ReplicaLayout.fixed` layout after :meth:`ReplicaLayout.update`: the shapes
        are the same, so a captured graph keeps reading these tensors)."""
        with torch.inference_mode():  # tables first built inside a forward are inference tensors
            fresh = SelectorTables(self.layout)
            for name, value in vars(fresh).items():
                if isinstance(value, torch.Tensor):
                    getattr(self, name).copy_(value)

    def _build(self, layout: ReplicaLayout) -> None:
        experts, slots, width, gpus = layout.num_experts, layout.num_slots, layout.width, layout.num_gpus
        device = layout.device
        hot = layout.max_spread if layout.fixed else layout.num_spread
        self.layout = layout
        self.experts = torch.arange(experts, device=device)
        self.replica = torch.arange(width, device=device)
        slot_or_pad = torch.where(layout.valid, layout.log2phy, slots)
        self.slot_or_pad = slot_or_pad.flatten()
        single = layout.logcnt == 1
        self.single_slot = torch.where(single, layout.log2phy[:, 0], slots + 1)
        self.first_slot = layout.log2phy[:, 0].contiguous()
        self.hot_weight: torch.Tensor | None = None
        if layout.fixed:  # padding rows: expert 0 with no demand, replicas on GPU 0 and the sentinel
            real = layout.spread_valid[:hot]
            self.hot = torch.where(real, layout.spread[:hot], 0)
            self.hot_weight = real.to(torch.float64)
        else:
            self.hot = layout.spread[:hot]
        self.hot_gpu = layout.spread_gpu[:hot]
        self.hot_rows = self.hot_gpu.unbind(0)
        hot_slot = slot_or_pad.index_select(0, self.hot)
        self.hot_slot = hot_slot.flatten()
        self.hot_next = torch.cat([hot_slot[:, 1:], torch.full_like(hot_slot[:, :1], slots + 1)], 1).flatten()
        self.fixed = torch.zeros(gpus + 1, experts, dtype=torch.float64, device=device)
        self.fixed.index_put_((layout.single_gpu, self.experts), single.to(torch.float64))
        self.sentinel = torch.zeros(gpus + 1, dtype=torch.float64, device=device)
        self.sentinel[gpus] = FULL
        self.ranks = torch.arange(1, width + 1, dtype=torch.float64, device=device)
        reach = (width if width <= SUBSET_REACH else 0) if layout.fixed else layout.spread_reach
        self.subsets: torch.Tensor | None = None
        self.sizes = torch.ones(1, dtype=torch.float64, device=device)
        if 0 < reach <= SUBSET_REACH:
            bits = (torch.arange(1, 1 << reach, device=device)[:, None] >> self.replica[None, :reach]) & 1
            member = bits.to(torch.float64)  # [M, reach]
            onehot = torch.zeros(hot, reach, gpus + 1, dtype=torch.float64, device=device)
            onehot.scatter_(2, self.hot_gpu[:, :reach, None], 1.0)
            self.subsets = torch.matmul(member, onehot)  # [H, M, G + 1]
            self.sizes = member.sum(1)


def tables_of(layout: ReplicaLayout) -> SelectorTables:
    """The :class:`SelectorTables` of ``layout``, built at the first call and kept on it
    (:attr:`ReplicaLayout.tables`; :meth:`ReplicaLayout.update` keeps them current).
    Device ops only."""
    if layout.tables is None:
        layout.tables = SelectorTables(layout)
    return layout.tables


def water_fill(total: torch.Tensor, tables: SelectorTables, sweeps: int) -> torch.Tensor:
    """Block-coordinate water-filling of the replicated experts' copies, hottest first.

    Args:
        total: ``[E]`` int64 copies per expert over the whole batch.
        tables: the layout's tables (same device).
        sweeps: passes over the replicated experts; one pass when a single expert is
            replicated (its water-filling is then exact).

    Returns:
        ``[H, R]`` float64 fractional copies per replica of each replicated expert (rows in
        ``tables.hot`` order; padding and same-GPU replicas get 0). Device ops only.
    """
    hot, ranks = tables.hot.shape[0], tables.ranks
    real = total.to(torch.float64)
    load = torch.addmv(tables.sentinel, tables.fixed, real)
    demand = real.index_select(0, tables.hot)
    if tables.hot_weight is not None:  # a fixed layout's padding rows demand nothing
        demand = demand * tables.hot_weight
    rows, subsets, order = tables.hot_rows, tables.subsets, None
    if hot > 1:
        order = torch.argsort(demand, descending=True, stable=True)
        demand, rows = demand.index_select(0, order), tables.hot_gpu.index_select(0, order).unbind(0)
        subsets = subsets.index_select(0, order) if subsets is not None else None
    need, sets = demand.unbind(0), subsets.unbind(0) if subsets is not None else ()
    passes = sweeps if hot > 1 else 1
    shares: list[torch.Tensor] = []
    for p in range(passes):
        for i in range(hot):
            if p:  # the row's own share taken off
                load.index_add_(0, rows[i], shares[i], alpha=-1)
            if sets:
                h = torch.addmv(need[i], sets[i], load).div_(tables.sizes).min()
                level = load.index_select(0, rows[i])
            else:
                level = load.index_select(0, rows[i])
                h = torch.sort(level).values.cumsum_(0).add_(need[i]).div_(ranks).min()
            x = (h - level).clamp_(min=0)
            if p < passes - 1 or i < hot - 1:  # the last row's loads are never read again
                load.index_add_(0, rows[i], x)
            if p:
                shares[i] = x
            else:
                shares.append(x)
    out = torch.stack(shares)
    return out if order is None else torch.empty_like(out).index_copy_(0, order, out)


def round_shares(total: torch.Tensor, shares: torch.Tensor | None, tables: SelectorTables) -> torch.Tensor:
    """``[P + 2]`` int64 whole-batch copies per slot (scratch entries as in the module
    doc): single-replica experts' totals at their slot, and ``shares`` (``[H, R]`` float64,
    as :func:`water_fill` returns them; ``None`` when ``H = 0``) rounded by cumulative
    share: each replica's count is within 1 of its share. Each row of ``shares`` sums to
    its expert's total up to float error (far below 0.5), so the rounded cumulative share
    at its last replica is that total exactly."""
    out = torch.zeros(tables.layout.num_slots + 2, dtype=torch.int64, device=total.device)
    out.index_add_(0, tables.single_slot, total)  # (an integer mv has no CUDA kernel)
    if shares is None:
        return out
    bounds = shares.cumsum(1).add_(0.5).to(torch.int64).flatten()  # the floor: every value is >= 0.5
    out.index_add_(0, tables.hot_slot, bounds)
    return out.index_add_(0, tables.hot_next, bounds, alpha=-1)  # count = bound - the bound before


def assign(ids: torch.Tensor, counts: torch.Tensor, rank: int, tables: SelectorTables,
           quotas: torch.Tensor) -> Selection:
    """Route rank ``rank``'s copies ``ids`` (``[N]``) by the whole-batch ``quotas``
    (``[P + 2]`` int64, from :func:`round_shares` or an even split). The copies of each
    expert are numbered over the ranks (rank order, then flat order); copy ``g`` goes to
    the replica whose quota interval holds ``g``. With every expert's intervals laid end
    to end (expert-major), this rank's copies sorted by expert sit at positions
    ``0 .. N-1`` shifted per expert by the copies before them on other ranks, and one
    ``searchsorted`` finds each copy's replica. ``counts``: ``[W, E]`` int64, every rank's
    copies per expert. Device ops only."""
    layout = tables.layout
    if tables.hot.shape[0] == 0:  # one replica each: nothing to choose
        slots = tables.first_slot.index_select(0, ids)
    else:
        order = torch.argsort(ids, stable=True)
        upper = quotas.index_select(0, tables.slot_or_pad).cumsum_(0)
        position = torch.arange(ids.numel(), device=ids.device)
        if counts.shape[0] > 1:
            mine = counts[rank]
            other = counts.sum(0) - mine
            shift = other.cumsum(0) - other + counts[:rank].sum(0)
            position += shift.index_select(0, ids.index_select(0, order))
        chosen = tables.slot_or_pad.index_select(0, torch.searchsorted(upper, position, right=True))
        slots = torch.empty_like(ids).scatter_(0, order, chosen)
    if counts.shape[0] == 1:  # the one rank sends the whole batch
        return Selection(slots=slots, sent=quotas[: layout.num_slots], quotas=quotas[: layout.num_slots])
    return Selection(slots=slots, sent=copies_per_id(slots, layout.num_slots), quotas=quotas[: layout.num_slots])
