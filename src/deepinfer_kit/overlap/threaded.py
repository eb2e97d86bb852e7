"""ThreadExecutor: runs steps on one worker thread so the host can plan the next step."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from queue import SimpleQueue
from typing import TYPE_CHECKING

import attrs

from deepinfer_kit._validators import require_ints_at_least
from deepinfer_kit.errors import InvariantError
from deepinfer_kit.overlap.records import Finish, PendingStep, TwoPhaseRun
from deepinfer_kit.step import StepResult

if TYPE_CHECKING:
    from deepinfer_kit.overlap.protocols import OverlapExecutor

__all__ = ["ThreadExecutor"]


@attrs.define(slots=True, eq=False)
class _Job:
    run: Callable[[], StepResult]
    future: Future[StepResult]


@attrs.define(slots=True, eq=False)
class _Nudge:
    """The caller waits for ``future``: finish it now if the worker holds it launched."""

    future: Future[StepResult]


@attrs.define(slots=True, eq=False)
class _Counts:
    pipelined: int = 0  # launches made while the step before was launched, not finished


_Item = _Job | _Nudge | None  # None: stop


class ThreadExecutor:
    """Runs the device part of each step on a single worker thread, in launch order.

    With one worker, steps complete in the order they were launched; torch releases the
    GIL inside its kernels, so host-side scheduling proceeds while a CPU forward runs.
    Callers that launch step ``k + 1`` before waiting for step ``k`` must resolve the
    inputs that depend on step ``k``'s tokens inside ``run`` (placeholders).

    With ``pipeline``, a :class:`TwoPhaseRun` is launched and kept unfinished until the
    caller launches the next step or waits for this one: a next step whose ``pipelines``
    allows it is then launched *before* this one is finished (on a GPU its kernels are
    queued before the worker blocks on this step's tokens); otherwise this one is
    finished first. Which happens depends only on the order of the caller's calls, never
    on timing. Plain callables always run to the end in one go.

    Args:
        depth: steps in flight while the host schedules.
        pipeline: launch a two-phase step before finishing the one before it (worth it
            where launching is asynchronous: a GPU; on CPU a launch is the whole forward,
            so the default ``False`` runs each step to the end).

    Raises:
        ConfigError: ``depth < 1``.
    """

    def __init__(self, depth: int = 1, *, pipeline: bool = False) -> None:
        require_ints_at_least(1, depth=depth)
        self._depth = depth
        self.pipeline = pipeline
        self._counts = _Counts()
        self._queue: SimpleQueue[_Item] = SimpleQueue()
        self._thread: threading.Thread | None = threading.Thread(
            target=_work, args=(self._queue, pipeline, self._counts), name="deepinfer-step", daemon=True
        )
        self._thread.start()
        self._stop = weakref.finalize(self, _stop_worker, self._queue, self._thread)  # also at exit

    @property
    def depth(self) -> int:
        """Steps allowed in flight while the host schedules."""
        return self._depth

    @property
    def num_pipelined(self) -> int:
        """Steps launched while the step before them was launched and not yet finished."""
        return self._counts.pipelined

    def launch(self, step_id: int, run: Callable[[], StepResult]) -> PendingStep:
        """Queue ``run`` (a plain callable or a :class:`TwoPhaseRun`) on the worker and
        return at once.

        Raises:
            InvariantError: the executor was closed.
        """
        if self._thread is None:
            raise InvariantError("launch on a closed ThreadExecutor")
        future: Future[StepResult] = Future()
        self._queue.put(_Job(run, future))
        return PendingStep(step_id=step_id, handle=future)

    def wait(self, pending: PendingStep) -> StepResult:
        """Block until the step finished; re-raise its exception. Tells a pipelining
        worker to finish the step now if it holds it launched."""
        future = pending.handle
        if not isinstance(future, Future):
            raise TypeError(f"not a ThreadExecutor step: {pending!r}")
        if self.pipeline and not future.done() and self._thread is not None:
            self._queue.put(_Nudge(future))
        result = future.result()
        if not isinstance(result, StepResult):
            raise TypeError(f"step {pending.step_id} returned {type(result).__name__}, not StepResult")
        return result

    def close(self) -> None:
        """Finish every queued and launched step, then stop the worker. Idempotent."""
        if self._thread is not None:
            self._thread = None
            self._stop()


def _stop_worker(queue: SimpleQueue[_Item], thread: threading.Thread) -> None:
    """Ask the worker to finish what it holds and exit; wait for it (unless called on it)."""
    queue.put(None)
    if threading.current_thread() is not thread:
        thread.join()


def _work(queue: SimpleQueue[_Item], pipeline: bool, counts: _Counts) -> None:
    """The worker: take jobs in launch order; hold at most one launched, unfinished
    two-phase step (``held``) until the next job or a nudge for it arrives."""
    held: tuple[Future[StepResult], Finish] | None = None
    while True:
        item = queue.get()
        if item is None or isinstance(item, _Nudge):
            if held is not None and (item is None or item.future is held[0]):
                _settle(*held)
                held = None
            if item is None:
                return
            continue
        two = item.run if pipeline and isinstance(item.run, TwoPhaseRun) else None
        if held is not None and (two is None or not two.pipelines):
            _settle(*held)
            held = None
        if two is None:
            _settle(item.future, item.run)
            continue
        try:
            finish = two.launch()
        except BaseException as exc:  # noqa: BLE001 - this step's failure, kept for its waiter
            if held is not None:  # the step before still finishes, and first
                _settle(*held)
                held = None
            item.future.set_exception(exc)
            continue
        if held is not None:
            counts.pipelined += 1
            _settle(*held)
        held = (item.future, finish)


def _settle(future: Future[StepResult], run: Callable[[], StepResult]) -> None:
    """Run ``run`` and put its result, or its exception, into ``future``."""
    try:
        result = run()
    except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
        future.set_exception(exc)
    else:
        future.set_result(result)


if TYPE_CHECKING:
    _check: type[OverlapExecutor] = ThreadExecutor
