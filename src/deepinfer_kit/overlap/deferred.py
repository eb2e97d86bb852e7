"""DeferredExecutor: runs each step when it is waited for — for runners whose ``prepare``
has already started the device work elsewhere (a worker process), so that what is left
is collecting the result."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from deepinfer_kit._validators import require_ints_at_least
from deepinfer_kit.errors import InvariantError
from deepinfer_kit.overlap.records import PendingStep
from deepinfer_kit.step import StepResult

if TYPE_CHECKING:
    from deepinfer_kit.overlap.protocols import OverlapExecutor

__all__ = ["DeferredExecutor"]


class DeferredExecutor:
    """``launch`` keeps the step; ``wait`` runs it on the caller's thread.

    With a :class:`~deepinfer_kit.engine.remote.process_runner.ProcessRunner` the step's work
    began when its plan was sent (``prepare``), in another process; ``run`` only receives
    the reply, so no thread is needed for the host to schedule round ``k + 1`` while round
    ``k`` runs. With an in-process runner the step runs inside ``wait``: correct (results
    in launch order) but not overlapped.

    Args:
        depth: steps the engine keeps in flight while it schedules (1 overlaps).

    Raises:
        ConfigError: ``depth < 1``.
    """

    def __init__(self, depth: int = 1) -> None:
        require_ints_at_least(1, depth=depth)
        self._depth = depth
        self._open = True
        self._order: list[int] = []  # launched step ids not yet waited for, oldest first

    @property
    def depth(self) -> int:
        """Steps allowed in flight while the host schedules."""
        return self._depth

    def launch(self, step_id: int, run: Callable[[], StepResult]) -> PendingStep:
        """Keep ``run`` for :meth:`wait`; returns at once.

        Raises:
            InvariantError: the executor was closed.
        """
        if not self._open:
            raise InvariantError("launch on a closed DeferredExecutor")
        self._order.append(step_id)
        return PendingStep(step_id=step_id, handle=run)

    def wait(self, pending: PendingStep) -> StepResult:
        """Run the step now and return its result (re-raising its exception).

        Raises:
            InvariantError: an older launched step has not been waited for (steps complete
                in launch order).
        """
        run = pending.handle
        if not callable(run):
            raise TypeError(f"not a DeferredExecutor step: {pending!r}")
        if not self._order or self._order[0] != pending.step_id:
            raise InvariantError(
                f"step {pending.step_id} waited for before older steps {self._order[:1]}; "
                f"wait in launch order"
            )
        self._order.pop(0)
        result = run()
        if not isinstance(result, StepResult):
            raise TypeError(f"step {pending.step_id} returned {type(result).__name__}, not StepResult")
        return result

    def close(self) -> None:
        """Refuse later launches. Steps launched and not waited for are dropped. Idempotent."""
        self._open = False
        self._order.clear()


if TYPE_CHECKING:
    _check: type[OverlapExecutor] = DeferredExecutor
