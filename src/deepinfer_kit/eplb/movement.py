"""MovementAwarePlacementPolicy: keep replicas where they are across rebalances, count the bytes moved.

Shape symbols: ``L`` layers, ``E`` experts, ``P`` slots, ``G`` GPUs, ``S = P / G``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepinfer_kit.eplb.evaluate import step_balancedness
from deepinfer_kit.eplb.placement_ops import placement_from_phy2log
from deepinfer_kit.eplb.protocols import PlacementPolicy
from deepinfer_kit.eplb.records import Placement, Topology
from deepinfer_kit.errors import ConfigError

__all__ = ["align_placement", "MovementAwarePlacementPolicy"]


def align_placement(new: torch.Tensor, old: torch.Tensor, num_gpus: int, num_nodes: int) -> torch.Tensor:
    """Relabel ``new`` so it keeps as many of ``old``'s slots as it can, at no cost in balance.

    GPUs of one node are matched greedily by the experts they share (a GPU's set of
    replicas moves as a whole, so GPU loads and node membership are unchanged); inside a
    GPU, an expert it already held keeps its old slot.

    Args:
        new, old: ``[L, P]`` int64 ``phy2log`` maps; not mutated.
        num_gpus, num_nodes: the topology (nodes divide GPUs).

    Returns:
        ``[L, P]`` int64: ``new`` with GPUs and slots permuted.
    """
    layers, slots = new.shape
    per, width = num_gpus // num_nodes, slots // num_gpus
    rows = layers * num_nodes
    n = new.reshape(rows, per, width)
    o = old.reshape(rows, per, width)
    # overlap[x, i, j]: slots of new GPU i whose expert old GPU j holds, as a batched product
    # of per-GPU expert counts and presence (exact small integers in float32).
    experts = int(max(int(new.max()), int(old.max()))) + 1
    ones = torch.ones(rows, per, width)
    new_count = torch.zeros(rows, per, experts).scatter_add_(2, n, ones)
    old_held = torch.zeros(rows, per, experts).scatter_(2, o, 1.0)
    overlap = torch.bmm(new_count, old_held.transpose(1, 2)).double()  # [X, new, old]
    target = torch.empty(rows, per, dtype=torch.int64)
    row = torch.arange(rows)
    for _ in range(per):
        flat = overlap.view(rows, -1).argmax(dim=1)
        i, j = flat // per, flat % per
        target[row, i] = j
        overlap[row, i, :] = -1.0
        overlap[row, :, j] = -1.0
    moved = torch.empty_like(n).scatter_(1, target[:, :, None].expand_as(n), n).view(-1, width)
    before = o.reshape(-1, width)
    match = moved[:, :, None] == before[:, None, :]  # [Y, new slot, old slot]
    kept = match.any(1)
    result = torch.where(kept, before, -1)
    unmatched = ~match.any(2)
    free_first = torch.argsort((result != -1).to(torch.int8), dim=1, stable=True)
    new_first = torch.argsort((~unmatched).to(torch.int8), dim=1, stable=True)
    nfree = (result == -1).sum(1)
    fill = torch.arange(width) < nfree[:, None]
    values = torch.where(fill, moved.gather(1, new_first), result.gather(1, free_first))
    result = result.scatter(1, free_first, values)
    same_set = (nfree == unmatched.sum(1))[:, None] & (result >= 0).all(1, keepdim=True)
    return torch.where(same_set, result, moved).view(layers, slots)


class MovementAwarePlacementPolicy:
    """Wraps a policy: its plan is relabelled to keep replicas in place (:func:`align_placement`),
    and the previous placement is kept outright while it is within ``tolerance`` balancedness
    of the new plan on the current window (the mean over its steps of each step's
    balancedness). Composes with any inner policy, per-step ones included
    (:class:`~deepinfer_kit.eplb.peak.PeakPlacementPolicy`): the relabelling moves whole
    GPUs within a node and slots within a GPU, which changes no step's loads.

    Args:
        inner: the policy that plans.
        expert_bytes: bytes of one expert's weights (what moving a replica copies).
        tolerance: balancedness the previous placement may lose before it is replaced (0:
            replace whenever the new plan is strictly better on the current window).

    Raises:
        ConfigError: ``expert_bytes`` or ``tolerance`` negative.
    """

    def __init__(self, inner: PlacementPolicy, expert_bytes: int, tolerance: float = 0.0) -> None:
        if expert_bytes < 0:
            raise ConfigError(f"expert_bytes must be >= 0, got {expert_bytes}")
        if not tolerance >= 0.0:
            raise ConfigError(f"tolerance must be >= 0, got {tolerance}")
        self._inner = inner
        self._expert_bytes = expert_bytes
        self._tolerance = tolerance
        self._previous: Placement | None = None
        self._moved = 0

    @property
    def last_moved_replicas(self) -> int:
        """Slots whose expert changed in the last ``place`` (0 after the first)."""
        return self._moved

    @property
    def last_moved_bytes(self) -> int:
        """Expert-weight bytes the last rebalance copies: moved replicas x ``expert_bytes``."""
        return self._moved * self._expert_bytes

    def place(self, load: torch.Tensor, topology: Topology) -> Placement:
        """Plan with ``inner`` from ``load`` (``[S, L, E]`` per-step counts, passed on as
        is), then stay close to the previous placement. The tolerance compares the mean
        over the window's steps of each step's balancedness
        (:func:`~deepinfer_kit.eplb.evaluate.step_balancedness`).

        Mutates the remembered placement and the moved counters.

        Raises:
            ConfigError: as :meth:`PlacementPolicy.place`.
        """
        fresh = self._inner.place(load, topology)
        prev = self._previous
        if prev is None or prev.phy2log.shape != fresh.phy2log.shape:
            self._previous, self._moved = fresh, 0
            return fresh
        gpus = topology.num_gpus
        new = align_placement(fresh.phy2log, prev.phy2log, gpus, topology.num_nodes)
        if self._tolerance > 0.0:
            keep = step_balancedness(prev, load, gpus).mean(dim=0) >= (
                step_balancedness(fresh, load, gpus).mean(dim=0) - self._tolerance
            )
            new = torch.where(keep[:, None], prev.phy2log, new)
        placement = placement_from_phy2log(new, fresh.logcnt.shape[1])
        self._moved = int((placement.phy2log != prev.phy2log).sum())
        self._previous = placement
        return placement


if TYPE_CHECKING:
    _check: type[PlacementPolicy] = MovementAwarePlacementPolicy
