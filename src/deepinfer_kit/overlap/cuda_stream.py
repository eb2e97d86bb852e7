"""CudaStreamExecutor: the worker thread of :class:`ThreadExecutor`, issuing each step's
kernels on a CUDA stream of its own."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from deepinfer_kit.errors import DeviceUnavailableError
from deepinfer_kit.overlap.records import PendingStep
from deepinfer_kit.overlap.threaded import ThreadExecutor
from deepinfer_kit.step import StepResult

if TYPE_CHECKING:
    from deepinfer_kit.overlap.protocols import OverlapExecutor

__all__ = ["CudaStreamExecutor"]


class CudaStreamExecutor:
    """Runs each step's forward and sampling on a dedicated CUDA stream from a worker
    thread, in launch order, while the host plans and stages the next step.

    At :meth:`launch` an event is recorded on the caller's current stream (where the
    runner's ``prepare`` queued the step's non-blocking input copies); the step's stream
    waits for it, so a step never reads inputs still in flight, and the copies of step
    ``k + 1`` overlap the kernels of step ``k``. The worker blocks (GIL released) only
    on the one device-to-host copy of the sampled tokens.

    Args:
        device: the CUDA device of the model.
        depth: steps in flight while the host schedules (the engine takes 1).

    Raises:
        DeviceUnavailableError: ``device`` is not a CUDA device, or CUDA is missing.
        ConfigError: ``depth < 1``.
    """

    def __init__(self, device: torch.device | str = "cuda", depth: int = 1) -> None:
        dev = torch.device(device)
        if dev.type != "cuda" or not torch.cuda.is_available():
            raise DeviceUnavailableError(f"CudaStreamExecutor needs a CUDA device, got {str(dev)!r}")
        self._threads = ThreadExecutor(depth)
        self.device = dev
        self.stream = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]

    @property
    def depth(self) -> int:
        """Steps allowed in flight while the host schedules."""
        return self._threads.depth

    def launch(self, step_id: int, run: Callable[[], StepResult]) -> PendingStep:
        """Queue ``run`` on the worker, its kernels ordered after the caller's queued
        work; returns at once.

        Raises:
            InvariantError: the executor was closed.
        """
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record(torch.cuda.current_stream(self.device))
        stream = self.stream

        def on_stream() -> StepResult:
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                return run()

        return self._threads.launch(step_id, on_stream)

    def wait(self, pending: PendingStep) -> StepResult:
        """Block until the step finished; re-raise its exception."""
        return self._threads.wait(pending)

    def close(self) -> None:
        """Wait for queued steps, then for the stream; stop the worker. Idempotent."""
        self._threads.close()
        self.stream.synchronize()


if TYPE_CHECKING:
    _check: type[OverlapExecutor] = CudaStreamExecutor
