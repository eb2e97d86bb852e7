"""TorchCommunicator: the Communicator over a ``torch.distributed`` group, every collective
bounded by a timeout."""

from __future__ import annotations

from datetime import timedelta
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from deepinfer_kit.comm.protocols import Communicator
from deepinfer_kit.errors import CollectiveError, ConfigError

__all__ = ["TorchCommunicator"]


class TorchCommunicator:
    """Collectives over ``group`` (gloo for CPU tensors, NCCL for CUDA tensors).

    Each collective is issued asynchronously and waited for with ``timeout`` seconds;
    whatever goes wrong (a peer's socket closed, the wait expired, the backend raised)
    becomes a :class:`CollectiveError` naming the collective, this rank and the timeout.
    After one, the group is broken: the caller stops (the engine reports it dead).

    Args:
        group: an initialized process group, or ``None`` for the default (world) group.
        timeout: seconds one collective may take, ``> 0``.
        device: where :meth:`barrier`'s token lives (the backend's device: CPU for gloo,
            this rank's GPU for NCCL).

    Raises:
        ConfigError: ``timeout`` not positive; ``torch.distributed`` not initialized.
    """

    def __init__(self, group: dist.ProcessGroup | None, *, timeout: float,
                 device: torch.device | str = "cpu") -> None:
        if not timeout > 0:
            raise ConfigError(f"collective timeout must be > 0 seconds, got {timeout!r}")
        if not dist.is_initialized():
            raise ConfigError("TorchCommunicator needs torch.distributed initialized (join_world)")
        self.group = group
        self.timeout = float(timeout)
        self.device = torch.device(device)
        self._wait_for = timedelta(seconds=self.timeout)
        self._rank = dist.get_rank(group)
        self._world = dist.get_world_size(group)

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Ranks in the group."""
        return self._world

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """See :meth:`Communicator.all_reduce` (sum, in place)."""
        self._run(lambda: dist.all_reduce(tensor, group=self.group, async_op=True), "all_reduce")
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """See :meth:`Communicator.all_gather`."""
        part = tensor.contiguous()
        parts = [torch.empty_like(part) for _ in range(self._world)]
        self._run(lambda: dist.all_gather(parts, part, group=self.group, async_op=True), "all_gather")
        return torch.cat(parts, dim=dim)

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """See :meth:`Communicator.broadcast`; ``src`` is a rank of this group."""
        source = dist.get_global_rank(self.group, src) if self.group is not None else src
        self._run(lambda: dist.broadcast(tensor, source, group=self.group, async_op=True), "broadcast")
        return tensor

    def barrier(self) -> None:
        """See :meth:`Communicator.barrier` (an all-reduce of one element: a gloo barrier
        takes no timeout of its own)."""
        self.all_reduce(torch.zeros(1, device=self.device))

    def _run(self, issue: Callable[[], Any], name: str) -> None:
        """Issue one collective and wait for it, every failure a CollectiveError."""
        try:
            done = issue().wait(timeout=self._wait_for)
        except Exception as exc:  # noqa: BLE001 - every backend failure breaks the group
            raise CollectiveError(
                f"{name} failed on rank {self._rank} of {self._world} (timeout "
                f"{self.timeout:g} s): {exc}"
            ) from exc
        if done is False:
            raise CollectiveError(
                f"{name} timed out after {self.timeout:g} s on rank {self._rank} of {self._world}")


if TYPE_CHECKING:
    _check: type[Communicator] = TorchCommunicator
