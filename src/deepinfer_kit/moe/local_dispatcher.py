"""LocalDispatcher: single-device permute into expert-contiguous order, and weighted unpermute."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.moe.protocols import Dispatcher
from deepinfer_kit.moe.records import Dispatched, Routing

__all__ = [
    "LocalDispatcher",
    "check_routing",
    "count_experts",
    "sort_by_expert",
    "unpermute_and_sum",
]


def check_routing(hidden: torch.Tensor, routing: Routing) -> None:
    """Raise ``ConfigError`` unless ``routing`` has one ``[k]`` row per row of ``hidden``."""
    ids, weights = routing.expert_ids, routing.weights
    if hidden.dim() != 2:
        raise ConfigError(f"hidden must be [T, H], got shape {tuple(hidden.shape)}")
    if ids.dim() != 2 or ids.shape[0] != hidden.shape[0] or weights.shape != ids.shape:
        raise ConfigError(
            f"routing must be [T, k] for T = {hidden.shape[0]}, got expert_ids "
            f"{tuple(ids.shape)} and weights {tuple(weights.shape)}"
        )


def count_experts(flat_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[E]`` int64 copies per expert of ``flat_ids`` (``[N]``), on the host.

    Raises:
        ConfigError: an id outside ``[0, E)``.
    """
    try:
        counts = torch.bincount(flat_ids, minlength=num_experts).cpu()
    except RuntimeError as exc:  # negative ids
        raise ConfigError(f"expert_ids must be in [0, {num_experts}), got a negative id") from exc
    if counts.numel() != num_experts:
        raise ConfigError(
            f"expert_ids must be in [0, {num_experts}), got {counts.numel() - 1}"
        )
    return counts


def sort_by_expert(routing: Routing, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The expert-contiguous order of the ``T * k`` copies, and the copies per expert.

    Returns:
        ``(order [T * k] int64, counts [E] int64 on the host)``: ``order`` lists flat
        routing positions sorted by expert, stably (token order within an expert).

    Raises:
        ConfigError: an id outside ``[0, E)``.
    """
    flat_ids = routing.expert_ids.reshape(-1)
    counts = count_experts(flat_ids, num_experts)
    return torch.argsort(flat_ids, stable=True), counts


def unpermute_and_sum(
    rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Put sorted copies back in routing order and take each token's weighted sum.

    Args:
        rows: ``[T * k, H]`` outputs; row ``i`` belongs to flat routing position ``order[i]``.
        order: ``[T * k]`` int64, a permutation.
        weights: ``[T, k]`` routing weights.

    Returns:
        ``[T, H]`` in the dtype of ``rows``: ``sum_j weights[t, j] * row(t, j)``, added in
        routing order ``j = 0, 1, ...`` by elementwise ops (deterministic, no atomics, and
        batch-invariant: a token's sum reads only its own copies, whichever device or rank
        computed them — a batched matmul's kernel would change with the token count).
    """
    num_tokens, top_k = weights.shape
    unsorted = torch.empty_like(rows).index_copy_(0, order, rows)
    copies = unsorted.view(num_tokens, top_k, rows.shape[1])
    w = weights.to(rows.dtype)
    out = copies[:, 0] * w[:, :1]
    for j in range(1, top_k):
        out = out + copies[:, j] * w[:, j:j + 1]
    return out


class LocalDispatcher:
    """Permutes token copies into expert-contiguous order on one device and back.

    ``dispatch`` sorts the ``T * k`` copies by expert (stable: within an expert, copies stay
    in token order); ``combine`` is :func:`unpermute_and_sum`.

    Args:
        num_experts: ``E``.

    Raises:
        ConfigError: ``num_experts < 1``.
    """

    def __init__(self, num_experts: int) -> None:
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ConfigError(f"num_experts must be an int >= 1, got {num_experts!r}")
        self._num_experts = num_experts
        self._local = tuple(range(num_experts))

    @property
    def local_experts(self) -> tuple[int, ...]:
        """``(0, 1, ..., E - 1)``: every expert is local."""
        return self._local

    def dispatch(self, hidden: torch.Tensor, routing: Routing) -> Dispatched:
        """Group copies of ``hidden`` (``[T, H]``) by expert.

        Returns:
            :class:`Dispatched` with ``M = T * k`` rows; ``order`` indexes the flattened
            routing. One host sync (the per-expert counts). Mutates nothing.

        Raises:
            ConfigError: shapes disagree or an id is outside ``[0, E)``.
        """
        check_routing(hidden, routing)
        top_k = routing.expert_ids.shape[1]
        order, counts = sort_by_expert(routing, self._num_experts)
        return Dispatched(
            hidden=hidden.index_select(0, order // top_k),
            expert_counts=counts,
            weights=routing.weights.reshape(-1).index_select(0, order),
            order=order,
            num_tokens=hidden.shape[0],
            routed_counts=counts,
            state=routing.weights,
        )

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """``y[t] = sum_j w[t, j] * out[copy (t, j)]``.

        Args:
            expert_out: ``[T * k, H]`` unweighted expert outputs aligned with
                ``dispatched.hidden``.
            dispatched: what :meth:`dispatch` returned.

        Returns:
            ``[T, H]`` in the dtype of ``expert_out``.
        """
        weights = dispatched.state
        if not isinstance(weights, torch.Tensor):
            raise ConfigError("dispatched was not produced by LocalDispatcher.dispatch")
        return unpermute_and_sum(expert_out, dispatched.order, weights)


if TYPE_CHECKING:
    _check: type[Dispatcher] = LocalDispatcher
