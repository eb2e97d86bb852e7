"""Contracts of the moe package: Router and Dispatcher."""

from __future__ import annotations

from typing import Protocol

import torch

from deepinfer_kit.moe.records import Dispatched, Routing

__all__ = ["Router", "Dispatcher"]


class Router(Protocol):
    """Gating: chooses ``k`` experts per token and their combine weights."""

    @property
    def num_experts(self) -> int:
        """``E``, logical experts."""
        ...

    @property
    def top_k(self) -> int:
        """``k``, experts per token."""
        ...

    def __call__(self, hidden: torch.Tensor) -> Routing:
        """Route ``hidden`` (``[T, H]``) to experts; returns ids and weights ``[T, k]`` on the
        same device. Pure: no state changes."""
        ...


class Dispatcher(Protocol):
    """Moves token copies to their experts and their results back."""

    def dispatch(self, hidden: torch.Tensor, routing: Routing) -> Dispatched:
        """Group copies of ``hidden`` (``[T, H]``) by the experts in ``routing``.

        Expert-parallel dispatchers exchange the copies with the ranks holding each expert
        (a collective call: every rank of the group must call it).
        """
        ...

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """Weighted sum of each token's expert outputs: ``y = sum_e w_e E_e(x)``.

        Args:
            expert_out: ``[M, H]`` outputs aligned with ``dispatched.hidden``.
            dispatched: what :meth:`dispatch` returned.

        Returns:
            ``[T, H]`` in the dtype of ``expert_out``.
        """
        ...
