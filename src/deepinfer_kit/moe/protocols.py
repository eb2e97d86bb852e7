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
        """Route ``hidden`` (``[T, H]``) to experts; called once per MoE layer forward.

        Returns:
            :class:`Routing` with ids (``[T, k]`` int64, distinct per row, in ``[0, E)``)
            and float32 weights, on the device of ``hidden``. Per-expert counts for the
            step (what EPLB records) are ``routing.expert_counts(E)``.

        Pure: mutates nothing; the same input gives the same routing. ``O(T * E)``.
        """
        ...


class Dispatcher(Protocol):
    """Moves token copies to their experts and their results back."""

    @property
    def local_experts(self) -> tuple[int, ...]:
        """Logical expert id of each local physical expert slot (``S`` entries).

        Slot ``s`` computes the rows of :attr:`Dispatched.expert_counts` ``[s]``; the layer
        holds the weights of expert ``local_experts[s]`` there. ``range(E)`` on one device.
        """
        ...

    def dispatch(self, hidden: torch.Tensor, routing: Routing) -> Dispatched:
        """Group copies of ``hidden`` (``[T, H]``) by the expert slot that computes them.

        Called once per MoE forward, before the experts. Expert-parallel dispatchers
        exchange the copies with the ranks holding each expert (a collective call: every
        rank of the group must call it, possibly with ``T = 0``). Mutates nothing.
        ``Dispatched.routed_counts`` must equal ``routing.expert_counts(E)`` on the host.

        Raises:
            ConfigError: ``routing`` does not match ``hidden`` (row counts) or names an
                expert outside ``[0, E)``.
        """
        ...

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """Weighted sum of each token's expert outputs: ``y = sum_e w_e E_e(x)``.

        Called once after the experts ran on ``dispatched.hidden`` (collective for
        expert-parallel dispatchers).

        Args:
            expert_out: ``[M, H]`` unweighted outputs aligned with ``dispatched.hidden``.
            dispatched: what :meth:`dispatch` returned.

        Returns:
            ``[T, H]`` in the dtype of ``expert_out``, on its device.
        """
        ...
