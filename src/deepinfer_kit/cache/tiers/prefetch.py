"""Prefetch: the disk tier's reads for queued requests — started at arrival, and under the
``"wait"`` policy waited for until each request's deadline (no torch)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait

from deepinfer_kit.cache.tiers.disk_tier import DiskTier, ReadResult

__all__ = ["Prefetch"]


class Prefetch:
    """Each queued request's disk reads, keyed by block, and its deadline
    (``timeout_s`` after arrival). Called on the scheduler's thread; the reads run in the
    disk tier's I/O threads.

    Args:
        disk: the disk tier.
        timeout_s: ``TierConfig.prefetch_timeout_s``.
        wait_reads: ``prefetch == "wait"``: a run of reads is waited for until the
            request's deadline; else whatever has landed is taken.
    """

    def __init__(self, disk: DiskTier, timeout_s: float, wait_reads: bool) -> None:
        self._disk = disk
        self._timeout = timeout_s
        self._wait = wait_reads
        self._reads: dict[str, dict[bytes, Future[ReadResult]]] = {}
        self._deadline: dict[str, float] = {}

    def start(self, rid: str, keys: Sequence[bytes], first: int, remote: int,
              in_host: Callable[[bytes], bool]) -> None:
        """Request ``rid`` arrived: read the blocks of ``keys`` from ``first`` that the
        disk tier holds, skipping those ``in_host``, up to the first it lacks — past which,
        for the first ``remote`` blocks, another engine is writing them: those reads look
        again until the deadline."""
        deadline = time.monotonic() + self._timeout
        self._deadline[rid] = deadline
        disk = self._disk
        reads: dict[bytes, Future[ReadResult]] = {}
        for i in range(first, len(keys)):
            key = keys[i]
            if in_host(key):
                continue
            if disk.has(key):
                reads[key] = disk.read(key)
            elif i < remote:
                reads[key] = disk.read(key, deadline=deadline)
            else:
                break
        if reads:
            self._reads[rid] = reads

    def run(self, rid: str, keys: Sequence[bytes], j: int,
            in_host: Callable[[bytes], bool]) -> list[tuple[bytes, Future[ReadResult]]]:
        """The run of disk blocks of ``rid`` from ``keys[j]`` up to one ``in_host`` or not on
        disk (reads started now for those not started at arrival), waited for per the
        policy. Take each landed one with :meth:`taken`."""
        disk = self._disk
        reads = self._reads.setdefault(rid, {})
        run: list[tuple[bytes, Future[ReadResult]]] = []
        for key in keys[j:]:
            if in_host(key):
                break
            fut = reads.get(key)
            if fut is None:
                if not disk.has(key):
                    break
                fut = reads[key] = disk.read(key)
            run.append((key, fut))
        if run and self._wait:
            deadline = self._deadline.get(rid, time.monotonic() + self._timeout)
            wait([f for _, f in run], timeout=max(0.0, deadline - time.monotonic()))
        if not reads:
            del self._reads[rid]
        return run

    def taken(self, rid: str, key: bytes) -> None:
        """``rid``'s read of ``key`` was used (or found wanting): forget it."""
        reads = self._reads.get(rid)
        if reads is not None:
            reads.pop(key, None)
            if not reads:
                del self._reads[rid]

    def forget(self, rid: str) -> None:
        """``rid`` finished: cancel its reads not yet started."""
        self._deadline.pop(rid, None)
        for fut in self._reads.pop(rid, {}).values():
            fut.cancel()

    @property
    def num_requests(self) -> int:
        """Requests with reads outstanding."""
        return len(self._reads)
