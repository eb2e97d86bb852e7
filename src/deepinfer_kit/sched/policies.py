"""The built-in scheduling policies: admission keys and preemption-victim rules."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from deepinfer_kit.request import Request
from deepinfer_kit.sched.forks import will_fork

if TYPE_CHECKING:
    from deepinfer_kit.sched.protocols import AdmissionPolicy, PreemptionPolicy

__all__ = [
    "fair_share_victim",
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


def _family(request: Request) -> str:
    return request.parent_id if request.parent_id is not None else request.request_id


def fair_share_victim(
    running: Sequence[Request], head: Request, seats_needed: int, free_seats: int, max_num_seqs: int
) -> Request | None:
    """The fairness rule: whom to preempt so that ``head`` (first in the waiting queue,
    refused for want of seats) gets a seat, or ``None``.

    One request's sequences (a parent and its ``n - 1`` fork children) may hold more than
    half of ``max_num_seqs`` seats (and more than one) only while nobody else waits for
    one. When ``head``
    belongs to another request and lacks seats, the request holding the most seats gives
    one up, if it holds more than ``max_num_seqs // 2``: its member admitted last that has
    already forked (never a parent whose children do not exist yet). Returns ``None`` when
    no request holds more than its share, or when even bringing the largest down to its
    share would not free ``seats_needed - free_seats`` seats (then nothing is preempted
    in vain). Pure: reads ``running``, mutates nothing. O(R).
    """
    share = max_num_seqs // 2
    seats: dict[str, int] = {}
    for req in running:
        f = _family(req)
        seats[f] = seats.get(f, 0) + (req.params.n if will_fork(req) else 1)
    if not seats:
        return None
    largest = max(seats, key=lambda f: seats[f])
    if largest == _family(head) or seats[largest] <= max(share, 1):
        return None
    if seats_needed - free_seats > seats[largest] - share:
        return None
    for req in reversed(running):
        if _family(req) == largest and not will_fork(req):
            return req
    return None


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
