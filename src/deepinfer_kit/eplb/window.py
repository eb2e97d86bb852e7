"""LoadWindow: per-layer, per-expert token counts of each of the last W steps, kept on the device."""

from __future__ import annotations

import torch
import torch.distributed as dist

from deepinfer_kit._validators import require_ints_at_least
from deepinfer_kit.errors import ConfigError

__all__ = ["LoadWindow"]


class LoadWindow:
    """A ring of the last ``W`` steps' expert counts, ``[W, L, E]`` int64 on ``device``.

    ``record`` is an on-device copy (no host sync); ``steps`` returns the recorded rows
    oldest first and ``total`` their sum, each all-reduced over a given process group
    (expert-parallel ranks each count their own tokens).

    Args:
        num_layers: ``L``.
        num_experts: ``E``.
        window: ``W`` steps kept.
        device: where the ring lives (the routers' device).
        group: the process group to sum over in :meth:`steps` and :meth:`total`, or None
            for local counts.

    Raises:
        ConfigError: a size below 1.
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        window: int,
        device: torch.device | str = "cpu",
        group: dist.ProcessGroup | None = None,
    ) -> None:
        require_ints_at_least(1, num_layers=num_layers, num_experts=num_experts, window=window)
        self._ring = torch.zeros(window, num_layers, num_experts, dtype=torch.int64, device=device)
        self._steps = 0
        self._group = group

    @property
    def device(self) -> torch.device:
        """Where the ring lives; :meth:`record` takes counts on this device."""
        return self._ring.device

    @property
    def num_recorded(self) -> int:
        """Steps recorded since construction or :meth:`reset` (the ring keeps the last ``W``)."""
        return self._steps

    def record(self, counts: torch.Tensor) -> None:
        """Store one step's ``counts`` (``[L, E]``, any integer dtype, same device) over the oldest.

        Mutates the ring; asynchronous on CUDA (no host sync).

        Raises:
            ConfigError: ``counts`` has the wrong shape.
        """
        if tuple(counts.shape) != tuple(self._ring.shape[1:]):
            raise ConfigError(f"counts must have shape {tuple(self._ring.shape[1:])}, got {tuple(counts.shape)}")
        self._ring[self._steps % self._ring.shape[0]].copy_(counts, non_blocking=True)
        self._steps += 1

    def total(self) -> torch.Tensor:
        """``[L, E]`` int64 counts over the steps in the ring, on the ring's device.

        Collective when a group was given: every rank of it must call ``total`` together.
        """
        summed = self._ring.sum(dim=0)
        if self._group is not None:
            dist.all_reduce(summed, group=self._group)
        return summed

    def steps(self) -> torch.Tensor:
        """``[min(W, recorded), L, E]`` int64 the steps in the ring, oldest first, on the
        ring's device (a new tensor; ``[0, L, E]`` before any :meth:`record`): what a
        :class:`~deepinfer_kit.eplb.protocols.PlacementPolicy` plans from.

        Collective when a group was given (each row all-reduced, as :meth:`total`): every
        rank of it must call ``steps`` together.
        """
        width = self._ring.shape[0]
        if self._steps <= width:
            rows = self._ring[: self._steps].clone()
        else:
            start = self._steps % width
            rows = torch.cat([self._ring[start:], self._ring[:start]])
        if self._group is not None and rows.shape[0]:
            dist.all_reduce(rows, group=self._group)
        return rows

    def reset(self) -> None:
        """Zero the ring (e.g. after a rebalance, so the next window sees only new routing)."""
        self._ring.zero_()
        self._steps = 0
