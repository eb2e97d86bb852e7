"""Contracts of the moe package: Router, Dispatcher and ReplicaSelector."""

from __future__ import annotations

from typing import Protocol

import torch

from deepinfer_kit.moe.records import Dispatched, Routing
from deepinfer_kit.moe.replica_layout import ReplicaLayout, Selection

__all__ = ["Router", "Dispatcher", "ReplicaSelector"]


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


class ReplicaSelector(Protocol):
    """Dispatch-time balancing: which replica of its logical expert serves each routed
    copy of a batch (implementations in :mod:`deepinfer_kit.moe.selectors`)."""

    name: str
    """What ``EngineConfig(eplb={"dispatch": name})`` calls it."""

    def select(self, expert_ids: torch.Tensor, counts: torch.Tensor, rank: int,
               layout: ReplicaLayout) -> Selection:
        """Choose a physical slot for each of this rank's routed copies.

        Called once per MoE forward on every rank, before the dispatch. Device-side:
        no host sync, no Python branch on the data (capturable in a CUDA graph); pure
        and deterministic for given inputs; mutates nothing.

        Args:
            expert_ids: ``[N]`` int64 logical experts of this rank's copies, flat routing
                order, on the layout's device.
            counts: ``[W, E]`` int64 copies each rank routed to each expert (the
                all-gathered ``bincount`` of every rank's ids; ``[1, E]`` on one device).
                A whole-batch plan is a function of it alone, so every rank computes the
                same one.
            rank: this rank's row of ``counts``.
            layout: the layer's slot map.

        Returns:
            :class:`Selection`: ``slots[i]`` holds a replica of ``expert_ids[i]``;
            ``sent`` equals ``bincount(slots, minlength=P)``; ``quotas`` (when not None)
            equals the sum of every rank's ``sent``.

        Raises:
            ConfigError: shapes that disagree with the layout, or ``rank`` outside
                ``[0, W)``.
        """
        ...
