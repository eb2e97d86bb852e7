"""LocalCommunicator: the group of one rank (``T = 1``); every collective is the identity."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepinfer_kit.comm.protocols import Communicator

__all__ = ["LocalCommunicator"]


class LocalCommunicator:
    """A :class:`Communicator` of world size 1: nothing to exchange, nothing can time out."""

    @property
    def rank(self) -> int:
        """Always 0."""
        return 0

    @property
    def world_size(self) -> int:
        """Always 1."""
        return 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Returns ``tensor`` unchanged (the sum over one rank)."""
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Returns ``tensor`` unchanged (the only part)."""
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Returns ``tensor`` unchanged; ``src`` must be 0 (asserted: a caller bug)."""
        assert src == 0, src
        return tensor

    def barrier(self) -> None:
        """Returns at once."""


if TYPE_CHECKING:
    _check: type[Communicator] = LocalCommunicator
