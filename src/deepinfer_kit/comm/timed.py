"""TimedCommunicator: a Communicator wrapper that adds up the time and bytes its collectives
take (a benchmark's communication share, a trace's per-rank numbers)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import attrs
import torch

from deepinfer_kit.comm.protocols import Communicator

__all__ = ["CommStats", "TimedCommunicator"]


@attrs.frozen(slots=True)
class CommStats:
    """Collectives since the last :meth:`TimedCommunicator.take`.

    Attributes:
        calls: collectives issued.
        seconds: wall time spent inside them (waiting for peers included).
        bytes: payload bytes this rank contributed.
    """

    calls: int
    seconds: float
    bytes: int


class TimedCommunicator:
    """Forwards every collective to ``inner`` and records its wall time and payload.

    On CUDA the time is the host's (a collective's wait returns once it is enqueued or
    done, as the backend decides); on gloo it is the collective's own time.
    """

    def __init__(self, inner: Communicator) -> None:
        self.inner = inner
        self._calls = 0
        self._seconds = 0.0
        self._bytes = 0

    @property
    def rank(self) -> int:
        """See :attr:`Communicator.rank`."""
        return self.inner.rank

    @property
    def world_size(self) -> int:
        """See :attr:`Communicator.world_size`."""
        return self.inner.world_size

    def take(self) -> CommStats:
        """The totals since the last call (or construction); resets them."""
        stats = CommStats(self._calls, self._seconds, self._bytes)
        self._calls, self._seconds, self._bytes = 0, 0.0, 0
        return stats

    def _add(self, start: float, tensor: torch.Tensor | None) -> None:
        self._seconds += time.perf_counter() - start
        self._calls += 1
        if tensor is not None:
            self._bytes += tensor.numel() * tensor.element_size()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """See :meth:`Communicator.all_reduce`."""
        start = time.perf_counter()
        try:
            return self.inner.all_reduce(tensor)
        finally:
            self._add(start, tensor)

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """See :meth:`Communicator.all_gather`."""
        start = time.perf_counter()
        try:
            return self.inner.all_gather(tensor, dim)
        finally:
            self._add(start, tensor)

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """See :meth:`Communicator.broadcast`."""
        start = time.perf_counter()
        try:
            return self.inner.broadcast(tensor, src)
        finally:
            self._add(start, tensor)

    def barrier(self) -> None:
        """See :meth:`Communicator.barrier`."""
        start = time.perf_counter()
        try:
            self.inner.barrier()
        finally:
            self._add(start, None)


if TYPE_CHECKING:
    _check: type[Communicator] = TimedCommunicator
