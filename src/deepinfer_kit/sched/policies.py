"""The built-in scheduling policies: admission keys and preemption-victim rules."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from deepinfer_kit.request import Request

if TYPE_CHECKING:
    from deepinfer_kit.sched.protocols import AdmissionPolicy, PreemptionPolicy

__all__ = [
    "fcfs_key",
    "priority_key",
    "latest_arrival_victim",
    "lowest_priority_victim",
    "default_policies",
]


def fcfs_key(request: Request) -> tuple[float, ...]:
    """First come, first served: earlier ``arrival_time`` first."""
    return (request.arrival_time,)


def priority_key(request: Request) -> tuple[float, ...]:
    """Lower ``priority`` first, then earlier ``arrival_time``."""
    return (request.priority, request.arrival_time)


def latest_arrival_victim(running: Sequence[Request]) -> Request:
    """The running request that arrived last (ties: the one admitted last). O(R)."""
    victim = running[-1]
    for req in reversed(running):
        if req.arrival_time > victim.arrival_time:
            victim = req
    return victim


def lowest_priority_victim(running: Sequence[Request]) -> Request:
    """The running request with the largest ``priority`` value, latest arrival among
    equals (ties: the one admitted last). O(R)."""
    victim = running[-1]
    best = (victim.priority, victim.arrival_time)
    for req in reversed(running):
        key = (req.priority, req.arrival_time)
        if key > best:
            victim, best = req, key
    return victim


def default_policies(policy: str) -> tuple[AdmissionPolicy | None, PreemptionPolicy]:
    """The admission key and victim rule named by ``SchedulerConfig.policy``.

    The admission key is ``None`` for ``"fcfs"``: the scheduler then keeps the waiting
    queue as a deque in arrival order (O(1)), with preempted requests put back in front.
    """
    if policy == "priority":
        return priority_key, lowest_priority_victim
    return None, latest_arrival_victim


if TYPE_CHECKING:
    _fcfs: AdmissionPolicy = fcfs_key
    _prio: AdmissionPolicy = priority_key
    _latest: PreemptionPolicy = latest_arrival_victim
    _lowest: PreemptionPolicy = lowest_priority_victim
