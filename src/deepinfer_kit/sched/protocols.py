"""Contract of the sched package: the Scheduler."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from deepinfer_kit.cache.protocols import KVCacheManager
from deepinfer_kit.outputs import RequestOutput
from deepinfer_kit.request import Request
from deepinfer_kit.sched.records import PlainDecodeRun, SchedulePlan, SchedulerConfig, StretchResult
from deepinfer_kit.step import StepResult

if TYPE_CHECKING:
    from deepinfer_kit.sched.state import InflightPlan, SchedulerState

__all__ = [
    "Scheduler",
    "SchedulerFactory",
    "DraftRoom",
    "AdmissionPolicy",
    "PreemptionPolicy",
    "BatchingPolicy",
    "WaitingQueue",
]


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

        A request that can never run (see :meth:`never_fits`) is not queued silently
        forever: it is finished with reason ``error`` (``request.error`` names the limit)
        and reported by the next ``commit``. A prompt that fits but whose ``max_tokens``
        reach past ``max_model_len`` runs and finishes with ``length``.

        Raises:
            ConfigError: the request id is already live, or the request is not a fresh
                WAITING one.
        """
        ...

    def never_fits(self, request: Request) -> str | None:
        """Why ``request`` could never run under this scheduler, or ``None``.

        The one decision behind :meth:`add`'s rejection, exposed so an API edge can
        refuse such a request with an error before queueing it (the Engine does). Rules:
        its prompt alone reaches ``max_model_len``; its KV would need more blocks than
        the pool has; ``n > max_num_seqs``; its prompt exceeds the round budget with
        chunked prefill off; plus the batching policy's own rules. Pure; O(1).
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


@runtime_checkable
class DraftRoom(Protocol):
    """A scheduler that plans room for drafts a runner proposes as each round executes
    (the engine's speculation: :mod:`deepinfer_kit.engine.runner.drafting`)."""

    def reserve_drafts(self, num_draft: int) -> None:
        """From the next ``schedule()`` on, every decode chunk reserves budget and blocks
        for up to ``num_draft`` drafts (``ScheduledChunk.draft_room``); ``0`` turns it off.

        Raises:
            ConfigError: ``num_draft < 0``.
        """
        ...


class StretchSource(Protocol):
    """What a stretch of plain-decode rounds needs from its caller: how many rounds to
    run, the tokens each sequence samples in them (the caller's model), and the clock
    moved to the end of the rounds applied before their last commit reads it."""

    def rounds(self, run: PlainDecodeRun) -> int:
        """Rounds of ``run`` to apply at most (the caller's world may change after
        them, e.g. a request arrives); ``<= 0`` applies none. Called once per
        :meth:`DecodeStretches.advance_plain_decodes`, before :meth:`tokens`."""
        ...

    def tokens(self, request_id: str, first: int, count: int) -> Sequence[int]:
        """The ``count`` tokens ``request_id`` samples at output positions ``first``,
        ``first + 1``, ...; called once per running sequence of the stretch."""
        ...

    def applied(self, rounds: int) -> None:
        """``rounds`` (``>= 1``) rounds were applied: move the scheduler's clock to the
        end of the last one now, before that round's stop checks retire sequences
        (their finish times read it). Called at most once, after :meth:`tokens`."""
        ...


@runtime_checkable
class DecodeStretches(Protocol):
    """A scheduler that applies a stretch of plain-decode rounds at once when the caller
    knows their sampled tokens ahead (the simulator's synthetic model): the requests and
    the cache end as the rounds' own ``schedule`` / ``commit`` pairs would leave them."""

    def plain_decode_run(self) -> PlainDecodeRun | None:
        """The running sequences (ids, next starts, output positions, rounds before a
        length limit) when the next round would plan exactly one plain decode for each of
        them and nothing else; ``None`` when it would plan anything more or different.
        Called between a commit and the next ``schedule()``; mutates no decision (only
        per-sequence caches the next round would fill alike)."""
        ...

    def advance_plain_decodes(self, source: StretchSource) -> StretchResult:
        """When :meth:`plain_decode_run` is a run, apply up to ``source.rounds(run)`` of
        its rounds, sequence ``i`` sampling ``source.tokens(...)[r]`` in round ``r``,
        through the first round in which a token may end a sequence (that round's commit
        applies the stop rules and retires what they finish) and before a round whose
        new blocks the cache lacks. Mutates the requests, the cache and the step counter
        as those rounds would, and calls ``source.applied`` before the last round's
        retirements. Returns the free blocks after each round's planning (empty: nothing
        applied, and nothing changed) and the outputs of the sequences the last round
        finished.

        Raises:
            InvariantError: a token list shorter than the rounds asked for.
        """
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


class BatchingPolicy(Protocol):
    """When waiting sequences join the running set: every round (continuous batching),
    or only once the whole batch has drained (static batching).

    The round calls :meth:`admit` once, after every running sequence got its chunk. A
    non-``preemptive`` policy guarantees blocks at admission; a shortfall is then a
    broken invariant rather than a reason to preempt.
    """

    @property
    def preemptive(self) -> bool:
        """True when running out of blocks preempts a victim by recompute."""
        ...

    def never_fits(self, request: Request, state: SchedulerState) -> str | None:
        """A reason, beyond the scheduler's common rules, why ``request`` could never
        run under this policy, or ``None``. Pure."""
        ...

    def admit(self, state: SchedulerState, entry: InflightPlan, budget: int, preempted: bool) -> int:
        """Move waiting sequences into ``state.running`` and append their first chunks to
        ``entry`` (the round being planned); returns the budget left. ``preempted`` says this round already
        preempted someone (continuous batching then admits nothing). Mutates the state,
        the requests and the cache's block tables."""
        ...


class WaitingQueue(Protocol):
    """Sequences holding no blocks, in admission order (internal to the schedulers)."""

    def __len__(self) -> int:
        """Queued sequences. O(1)."""
        ...

    def __iter__(self) -> Iterator[Request]:
        """The queued sequences in admission order (read-only)."""
        ...

    def push(self, request: Request) -> None:
        """Queue a new sequence."""
        ...

    def push_preempted(self, request: Request) -> None:
        """Queue a sequence that was preempted (it goes ahead of later arrivals)."""
        ...

    def peek(self) -> Request:
        """The next sequence to admit. Raises IndexError when empty."""
        ...

    def pop(self) -> Request:
        """Remove and return :meth:`peek`'s sequence."""
        ...

    def remove(self, request: Request) -> None:
        """Remove ``request`` (an abort). O(len). Raises ValueError when absent."""
        ...


SchedulerFactory = Callable[[SchedulerConfig, KVCacheManager], Scheduler]
"""``factory(config, cache)`` -> a scheduler over that KV cache manager: how the engine
builder and the conformance suite receive a scheduler of yours."""
