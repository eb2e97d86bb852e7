"""Fault injection for multi-rank engines: communicator wrappers (passed as ``wrap_comm``,
pickled to each worker) that make one rank die, fail or stall inside a collective."""

from __future__ import annotations

import os
import signal
import threading

import torch

from deepinfer_kit.comm.protocols import Communicator
from deepinfer_kit.errors import CollectiveError


class InjectedError(RuntimeError):
    """What a failing rank raises outside the communication layer."""


class FaultyComm:
    """Forwards to ``inner``; at collective number ``at`` (counted from 1 on this rank)
    it does ``fault``: ``"kill"`` (SIGKILL itself), ``"collective"`` (the backend fails:
    CollectiveError), ``"raise"`` (an ordinary exception, the peers left waiting) or
    ``"stall"`` (never returns: a hung rank)."""

    def __init__(self, inner: Communicator, fault: str, at: int) -> None:
        self.inner = inner
        self.fault = fault
        self.at = at
        self.calls = 0

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    def _strike(self) -> None:
        self.calls += 1
        if self.calls != self.at:
            return
        if self.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fault == "collective":
            raise CollectiveError(f"injected backend failure on rank {self.rank}")
        if self.fault == "raise":
            raise InjectedError(f"injected failure on rank {self.rank}")
        if self.fault == "stall":
            threading.Event().wait()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self._strike()
        return self.inner.all_reduce(tensor)

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        self._strike()
        return self.inner.all_gather(tensor, dim)

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        self._strike()
        return self.inner.broadcast(tensor, src)

    def barrier(self) -> None:
        self._strike()
        self.inner.barrier()


class FaultOnRank:
    """``wrap_comm``: rank ``rank``'s communicator becomes a :class:`FaultyComm`."""

    def __init__(self, rank: int, fault: str, at: int) -> None:
        self.rank, self.fault, self.at = rank, fault, at

    def __call__(self, comm: Communicator) -> Communicator:
        return FaultyComm(comm, self.fault, self.at) if comm.rank == self.rank else comm
