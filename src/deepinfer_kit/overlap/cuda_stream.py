"""CudaStreamExecutor: the worker thread of :class:`ThreadExecutor`, issuing each step's
kernels on a CUDA stream of its own."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from deepinfer_kit.errors import DeviceUnavailableError
from deepinfer_kit.overlap.records import Finish, PendingStep, TwoPhaseRun
from deepinfer_kit.overlap.threaded import ThreadExecutor
from deepinfer_kit.step import StepResult

if TYPE_CHECKING:
    from deepinfer_kit.overlap.protocols import OverlapExecutor

__all__ = ["CudaStreamExecutor", "StreamKeepAlive"]


class _Event(Protocol):
    def record(self, stream: torch.cuda.Stream) -> None: ...

    def query(self) -> bool: ...


class StreamKeepAlive:
    """Holds what a step's kernels read until its stream has passed them: what
    ``Tensor.record_stream`` does for one tensor, for everything a step's closure holds.

    A step's inputs are allocated on the host's stream and read on the executor's; the
    caching allocator knows only the first. Once a step's closure is dropped (at once, when
    it raised after queuing kernels, or when it returned without waiting for them), the
    host's next allocation could reuse that memory while a kernel still reads it. Each
    step's closure is therefore kept, with an event recorded on the stream after its
    kernels, until the event has completed.

    Args:
        make_event: a new event (``torch.cuda.Event`` on a GPU; any object with ``record``
            and ``query`` in tests).
    """

    def __init__(self, make_event: Callable[[], _Event]) -> None:
        self._make_event = make_event
        self._held: deque[tuple[_Event, object]] = deque()

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, obj: object, stream: torch.cuda.Stream) -> None:
        """Keep ``obj`` until ``stream`` passes the work queued on it so far."""
        event = self._make_event()
        event.record(stream)
        self._held.append((event, obj))

    def release_passed(self) -> None:
        """Drop what the stream has passed, oldest first (events complete in order)."""
        while self._held and self._held[0][0].query():
            self._held.popleft()

    def clear(self) -> None:
        """Drop everything (after the stream was synchronised)."""
        self._held.clear()


class CudaStreamExecutor:
    """Runs each step's forward and sampling on a dedicated CUDA stream from a worker
    thread, in launch order, while the host plans and stages the next step.

    At :meth:`launch` an event is recorded on the caller's current stream (where the
    runner's ``prepare`` queued the step's non-blocking input copies); the step's stream
    waits for it, so a step never reads inputs still in flight, and the copies of step
    ``k + 1`` overlap the kernels of step ``k``. The worker blocks (GIL released) only
    on the one device-to-host copy of the sampled tokens. Each step's closure (and with
    it its input buffers) lives until the stream has passed its kernels
    (:class:`StreamKeepAlive`), whether it returned or raised.

    With ``pipeline`` (the default), a :class:`TwoPhaseRun` is launched and its finish
    (the wait for its tokens) is put off until the caller launches the next step or waits
    for this one; a next step that may pipeline is launched first, so its kernels are
    queued behind this step's before the worker blocks (see :class:`ThreadExecutor`).

    Args:
        device: the CUDA device of the model.
        depth: steps in flight while the host schedules (the engine takes 1).
        pipeline: launch a two-phase step before finishing the one before it.

    Raises:
        DeviceUnavailableError: ``device`` is not a CUDA device, or CUDA is missing.
        ConfigError: ``depth < 1``.
    """

    def __init__(self, device: torch.device | str = "cuda", depth: int = 1, *, pipeline: bool = True) -> None:
        dev = torch.device(device)
        if dev.type != "cuda" or not torch.cuda.is_available():
            raise DeviceUnavailableError(f"CudaStreamExecutor needs a CUDA device, got {str(dev)!r}")
        self._threads = ThreadExecutor(depth, pipeline=pipeline)
        self.device = dev
        self.stream = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
        self.alive = StreamKeepAlive(torch.cuda.Event)  # touched by the worker thread only

    @property
    def depth(self) -> int:
        """Steps allowed in flight while the host schedules."""
        return self._threads.depth

    @property
    def num_pipelined(self) -> int:
        """Steps launched while the step before them was launched and not yet finished."""
        return self._threads.num_pipelined

    def launch(self, step_id: int, run: Callable[[], StepResult]) -> PendingStep:
        """Queue ``run`` (a plain callable or a :class:`TwoPhaseRun`) on the worker, its
        kernels ordered after the caller's queued work; returns at once.

        Raises:
            InvariantError: the executor was closed.
        """
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record(torch.cuda.current_stream(self.device))
        stream, alive = self.stream, self.alive
        two = run if isinstance(run, TwoPhaseRun) and self._threads.pipeline else None

        def launch_on_stream() -> Finish:
            alive.release_passed()
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                try:
                    finish = two.launch() if two is not None else _finished(run())
                finally:
                    alive.hold(run, stream)

            def finish_on_stream() -> StepResult:
                with torch.cuda.stream(stream):
                    return finish()

            return finish_on_stream

        def whole() -> StepResult:
            return launch_on_stream()()

        if two is not None:
            return self._threads.launch(step_id, TwoPhaseRun(whole, launch_on_stream, pipelines=two.pipelines))
        return self._threads.launch(step_id, whole)

    def wait(self, pending: PendingStep) -> StepResult:
        """Block until the step finished; re-raise its exception."""
        return self._threads.wait(pending)

    def close(self) -> None:
        """Finish every queued and launched step, then wait for the stream; stop the
        worker. Idempotent."""
        self._threads.close()
        self.stream.synchronize()
        self.alive.clear()


def _finished(result: StepResult) -> Finish:
    """A finish that returns ``result`` (a plain callable's, run in its launch)."""
    return lambda: result


if TYPE_CHECKING:
    _check: type[OverlapExecutor] = CudaStreamExecutor
