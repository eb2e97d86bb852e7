"""Waiting queues: arrival order (a deque) or ordered by an admission key (a heap)."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

from deepinfer_kit.request import Request

if TYPE_CHECKING:
    from deepinfer_kit.sched.protocols import AdmissionPolicy, WaitingQueue

__all__ = ["FcfsQueue", "KeyedQueue", "make_waiting_queue"]


class FcfsQueue:
    """Arrival order; preempted requests go back to the front. O(1) except ``remove``."""

    __slots__ = ("_q",)

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)

    def push(self, request: Request) -> None:
        """Append at the back."""
        self._q.append(request)

    def push_preempted(self, request: Request) -> None:
        """Put at the front: victims are taken latest-arrival first, so successive
        victims end up in arrival order."""
        self._q.appendleft(request)

    def peek(self) -> Request:
        """The front request."""
        return self._q[0]

    def pop(self) -> Request:
        """Remove the front request."""
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        """Remove by identity. O(len)."""
        for i, req in enumerate(self._q):
            if req is request:
                del self._q[i]
                return
        raise ValueError(f"request {request.request_id!r} is not waiting")


class KeyedQueue:
    """Smallest admission key first; ties by entry order. O(log len) push and pop."""

    __slots__ = ("_heap", "_key", "_seq")

    def __init__(self, key: AdmissionPolicy) -> None:
        self._heap: list[tuple[tuple[float, ...], int, Request]] = []
        self._key = key
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[2] for entry in sorted(self._heap, key=lambda e: (e[0], e[1])))

    def push(self, request: Request) -> None:
        """Insert under ``key(request)``."""
        heapq.heappush(self._heap, (self._key(request), next(self._seq), request))

    def push_preempted(self, request: Request) -> None:
        """Insert under its key like any request (the key decides its place)."""
        self.push(request)

    def peek(self) -> Request:
        """The request with the smallest key."""
        return self._heap[0][2]

    def pop(self) -> Request:
        """Remove the request with the smallest key."""
        return heapq.heappop(self._heap)[2]

    def remove(self, request: Request) -> None:
        """Remove by identity. O(len)."""
        for i, entry in enumerate(self._heap):
            if entry[2] is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"request {request.request_id!r} is not waiting")


def make_waiting_queue(key: AdmissionPolicy | None) -> WaitingQueue:
    """A :class:`FcfsQueue` when ``key`` is ``None``, else a :class:`KeyedQueue`."""
    return FcfsQueue() if key is None else KeyedQueue(key)


if TYPE_CHECKING:
    _fcfs: type[WaitingQueue] = FcfsQueue
    _keyed: type[WaitingQueue] = KeyedQueue
