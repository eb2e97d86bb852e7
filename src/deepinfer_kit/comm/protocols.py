"""The Communicator Protocol: the collectives a tensor-parallel model calls."""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["Communicator"]


class Communicator(Protocol):
    """Collectives over one group of ranks (a tensor-parallel group).

    Every member is collective: each rank of the group calls it, in the same order, with
    tensors of the same shape and dtype, on the device the group's backend serves (CPU for
    gloo, this rank's CUDA device for NCCL). An implementation bounds each call by a
    timeout; a call that fails (a peer died or raised) or outlives it raises
    :class:`~deepinfer_kit.errors.CollectiveError`, after which the group is unusable.
    """

    @property
    def rank(self) -> int:
        """This process's rank in the group, ``0 <= rank < world_size``."""
        ...

    @property
    def world_size(self) -> int:
        """Ranks in the group (``T`` for tensor parallelism)."""
        ...

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it. Every rank ends with the
        same values. Any shape; contiguous.

        Raises:
            CollectiveError: a peer failed, or the call outlived the timeout.
        """
        ...

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along ``dim``, rank 0's first; returns a new
        tensor whose ``dim`` is ``world_size`` times longer. Every rank passes the same shape.

        Raises:
            CollectiveError: a peer failed, or the call outlived the timeout.
        """
        ...

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Overwrite ``tensor`` in place with rank ``src``'s values; returns it.

        Raises:
            CollectiveError: a peer failed, or the call outlived the timeout.
        """
        ...

    def barrier(self) -> None:
        """Return once every rank has called it.

        Raises:
            CollectiveError: a peer failed, or the call outlived the timeout.
        """
        ...
