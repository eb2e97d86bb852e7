"""ReplicaTable: a layer's logical -> physical expert map on the device, and moving weights to a new one.

Shape symbols: ``E`` logical experts, ``P`` physical slots of the layer, ``R = P - E + 1``
most replicas one expert can have, ``T`` tokens, ``k`` experts per token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.moe.counts import copies_per_id
from deepinfer_kit.moe.protocols import ReplicaSelector
from deepinfer_kit.moe.replica_layout import ReplicaLayout
from deepinfer_kit.moe.selectors import StaticSelector

__all__ = ["ReplicaTable", "move_slots"]


def _tables(phy2log: Sequence[int], num_experts: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log2phy [E, R], logcnt [E])`` of ``phy2log`` on the host; row ``e`` lists the
    slots of expert ``e`` in slot order, padded by repeating its first slot."""
    slots: list[list[int]] = [[] for _ in range(num_experts)]
    for s, e in enumerate(phy2log):
        slots[e].append(s)
    rows = [r + [r[0]] * (width - len(r)) for r in slots]
    return torch.tensor(rows, dtype=torch.int64), torch.tensor([len(r) for r in slots], dtype=torch.int64)


class ReplicaTable(nn.Module):
    """Which physical slot serves each routed copy, as device buffers replaced in place.

    Which replica serves each routed copy is the :attr:`selector`'s choice over the
    batch (default :class:`~deepinfer_kit.moe.selectors.StaticSelector`: copy ``j`` of
    token ``t`` routed to expert ``e`` goes to replica ``(t * k + j) % logcnt[e]``).
    Replicas hold identical weights, so which one serves a copy never changes the result. The buffers keep their storage across :meth:`assign` (a captured
    CUDA graph keeps reading the live table).

    Args:
        phy2log: ``P`` ints, the logical expert of each slot; every expert in ``[0, E)``
            at least once.
        num_experts: ``E``.
        device: where the buffers live (the layer's device).

    Raises:
        ConfigError: an id outside ``[0, E)`` or an expert without a slot.
    """

    def __init__(self, phy2log: Sequence[int], num_experts: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.num_slots = len(phy2log)
        self.width = self.num_slots - num_experts + 1
        self._host = self._check(phy2log)
        log2phy, logcnt = _tables(self._host, num_experts, self.width)
        self.phy2log: torch.Tensor
        self.log2phy: torch.Tensor
        self.logcnt: torch.Tensor
        self.register_buffer("phy2log", torch.tensor(self._host, dtype=torch.int64, device=device))
        self.register_buffer("log2phy", log2phy.to(device))
        self.register_buffer("logcnt", logcnt.to(device))
        self.selector: ReplicaSelector = StaticSelector()
        self.num_gpus = 1
        self.layout = ReplicaLayout(self._host, num_experts, 1, device)

    def use_selector(self, selector: ReplicaSelector, num_gpus: int, *, fixed: bool = False) -> None:
        """Choose replicas with ``selector`` from now on, balancing over ``num_gpus``
        (virtual) GPUs of ``P / num_gpus`` consecutive slots. Call between forwards.
        ``fixed``: a fixed-shape layout (:attr:`ReplicaLayout.fixed`), whose selector
        tables :meth:`assign` rewrites in place, for forwards captured as CUDA graphs.

        Raises:
            ConfigError: ``num_gpus`` does not divide the slots.
        """
        self.layout = ReplicaLayout(self._host, self.num_experts, num_gpus, self.phy2log.device, fixed=fixed)
        self.selector, self.num_gpus = selector, num_gpus

    def _check(self, phy2log: Sequence[int]) -> list[int]:
        slots = [int(e) for e in phy2log]
        if len(slots) != self.num_slots or any(not 0 <= e < self.num_experts for e in slots):
            raise ConfigError(
                f"phy2log must hold {self.num_slots} ids in [0, {self.num_experts}), got {slots}"
            )
        missing = sorted(set(range(self.num_experts)) - set(slots))
        if missing:
            raise ConfigError(f"phy2log must give every expert a slot, got none for {missing}")
        return slots

    @property
    def slot_experts(self) -> tuple[int, ...]:
        """The logical expert of each slot, on the host (``P`` ints)."""
        return tuple(self._host)

    def physical(self, expert_ids: torch.Tensor) -> torch.Tensor:
        """``[T, k]`` physical slots for the logical ``expert_ids`` (``[T, k]`` int64, on the
        buffers' device), chosen by :attr:`selector` from this batch's counts. No host
        sync; mutates nothing."""
        flat = expert_ids.reshape(-1)
        counts = copies_per_id(flat, self.num_experts)
        return self.selector.select(flat, counts[None], 0, self.layout).slots.view_as(expert_ids)

    def logical_counts(self, slot_counts: torch.Tensor) -> torch.Tensor:
        """``[E]`` int64 copies per logical expert from ``[P]`` copies per slot, on the
        device of ``slot_counts`` (no host sync)."""
        device = slot_counts.device
        index = self.phy2log if device == self.phy2log.device else torch.tensor(self._host, device=device)
        out = torch.zeros(self.num_experts, dtype=torch.int64, device=device)
        return out.index_add_(0, index, slot_counts.to(torch.int64))

    def sources(self, phy2log: Sequence[int]) -> list[int]:
        """For the map ``phy2log``: per slot, a slot that holds that expert now (the slot
        itself when it already does). Mutates nothing.

        Raises:
            ConfigError: as the constructor.
        """
        new = self._check(phy2log)
        first = {e: s for s, e in reversed(list(enumerate(self._host)))}
        return [s if self._host[s] == e else first[e] for s, e in enumerate(new)]

    def assign(self, phy2log: Sequence[int]) -> None:
        """Swap in the map ``phy2log`` (the weights must already be in place): in-place
        copies into the existing buffers, the selector's layout and its tables included
        (:meth:`ReplicaLayout.update`; a fixed layout's tables in place too), so a
        captured forward keeps reading the live map.

        Raises:
            ConfigError: as the constructor.
        """
        self._host = self._check(phy2log)
        log2phy, logcnt = _tables(self._host, self.num_experts, self.width)
        device = self.phy2log.device
        self.phy2log.copy_(torch.tensor(self._host, dtype=torch.int64).to(device))
        self.log2phy.copy_(log2phy.to(device))
        self.logcnt.copy_(logcnt.to(device))
        self.layout.update(self._host)


@torch.no_grad()
def move_slots(weights: Sequence[torch.Tensor], sources: Sequence[int]) -> int:
    """Copy slot ``sources[s]`` into slot ``s`` of every tensor in ``weights`` (``[P, ...]``
    each), for the slots whose source is another slot; returns how many slots changed.

    Reads every moved source before writing any destination, so a chain or a swap of
    slots is safe. Memory: one temporary of the moved slots.
    """
    moved = [s for s, src in enumerate(sources) if src != s]
    if not moved:
        return 0
    for w in weights:
        dst = torch.tensor(moved, device=w.device)
        src = torch.tensor([sources[s] for s in moved], device=w.device)
        w.index_copy_(0, dst, w.index_select(0, src))
    return len(moved)
