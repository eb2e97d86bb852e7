"""ThreadCommunicator: a Communicator whose ranks are threads of one process (tests run a
tensor-parallel model's shards side by side without starting processes)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch


class ThreadGroup:
    """What the ranks of one thread group share: a barrier and one slot per rank."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=60)
        self.slots: list[Any] = [None] * world


class ThreadCommunicator:
    """Rank ``rank`` of ``group``; reductions sum in rank order, so every rank gets the
    same bits, as a real backend's do."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group = group
        self._rank = rank
        self.calls = 0

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self.group.world

    def _exchange(self, value: Any) -> list[Any]:
        self.calls += 1
        self.group.slots[self._rank] = value
        self.group.barrier.wait()
        parts = list(self.group.slots)
        self.group.barrier.wait()
        return parts

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(tensor.clone())
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return tensor.copy_(total)

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat(self._exchange(tensor.clone()), dim=dim)

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return tensor.copy_(self._exchange(tensor.clone())[src])

    def barrier(self) -> None:
        self._exchange(None)


def thread_group(world: int) -> list[ThreadCommunicator]:
    """The ``world`` communicators of one new group, rank 0 first."""
    group = ThreadGroup(world)
    return [ThreadCommunicator(group, r) for r in range(world)]


def run_ranks(work: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run ``work[r]`` on thread ``r`` and return each result (re-raising the first error)."""
    results: list[Any] = [None] * len(work)
    errors: list[BaseException] = []

    def body(r: int) -> None:
        try:
            results[r] = work[r]()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(len(work))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
