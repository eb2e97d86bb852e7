"""Contract of the sched package: the Scheduler."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from deepinfer_kit.outputs import RequestOutput
from deepinfer_kit.request import Request
from deepinfer_kit.sched.records import SchedulePlan, StepResult

__all__ = ["Scheduler", "AdmissionPolicy", "PreemptionPolicy"]


class Scheduler(Protocol):
    """Decides, each round, which requests run and how many tokens each computes.

    The engine calls ``schedule()`` then, once the round has executed, ``commit`` with
    the plan and its result. Under overlap a second ``schedule()`` may come before the
    first plan is committed; requests scheduled in a plan still in flight get
    placeholder tokens.
    """

    @property
    def num_unfinished(self) -> int:
        """Requests added and not yet reported finished (waiting, running, preempted)."""
        ...

    def add(self, request: Request) -> None:
        """Queue a new request (status WAITING).

        A request that can never run (its prompt alone reaches ``max_model_len``, its
        KV would need more blocks than the pool has, ``n > max_num_seqs``, or its prompt
        exceeds the round budget with chunked prefill off) is not queued silently
        forever: it is finished with reason ``error`` (``request.error`` names the limit)
        and reported by the next ``commit``. A prompt that fits but whose ``max_tokens``
        reach past ``max_model_len`` runs and finishes with ``length``.

        Raises:
            ConfigError: the request id is already live, or the request is not a fresh
                WAITING one.
        """
        ...

    def abort(self, request_id: str) -> bool:
        """Finish a request with reason ``abort`` in any state; its blocks are freed
        (after the in-flight step that reads them completes). Returns False for an
        unknown or already finished id. The output is reported by the next ``commit``."""
        ...

    def schedule(self) -> SchedulePlan:
        """Plan one round within the token budget and ``max_num_seqs``.

        Mutates the queues, allocates blocks (preempting by recompute when they run out)
        and advances ``num_computed_tokens`` of the scheduled requests.
        """
        ...

    def commit(self, plan: SchedulePlan, result: StepResult) -> list[RequestOutput]:
        """Apply a round's sampled tokens: append them, check stop conditions, finish and
        free requests, publish newly full blocks to the prefix cache.

        Returns a :class:`RequestOutput` for each sequence that finished in this round (or
        was aborted / rejected since the last commit). Plans must be committed in the
        order they were scheduled.
        """
        ...

    def has_unfinished(self) -> bool:
        """True while any request is waiting, running or preempted."""
        ...


class AdmissionPolicy(Protocol):
    """Order of the waiting queue: requests with smaller keys are admitted first.

    Called once when a request enters the waiting queue (on ``add`` and when it is
    preempted); keys are compared as tuples, ties fall back to queue-entry order. A key
    must not change while the request waits. O(1) expected.
    """

    def __call__(self, request: Request) -> tuple[float, ...]:
        """The admission key of ``request`` (read-only)."""
        ...


class PreemptionPolicy(Protocol):
    """Chooses which running request gives its blocks back when an allocation fails.

    Called only when blocks run out (rare), so O(len(running)) is fine. The scheduler
    frees the victim's blocks and requeues it for recomputation; the victim may be the
    request that needed the blocks.
    """

    def __call__(self, running: Sequence[Request]) -> Request:
        """The victim among ``running`` (non-empty, in admission order; read-only)."""
        ...
