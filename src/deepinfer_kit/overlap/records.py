"""Records of the overlap package: a launched step's handle, and a step in two phases."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from deepinfer_kit.step import StepResult

__all__ = ["Finish", "PendingStep", "TwoPhaseRun"]

Finish = Callable[[], StepResult]
"""What a two-phase step's launch returns: waits for the step's tokens, returns its result."""


@attrs.define(slots=True, eq=False)
class PendingStep:
    """A launched step that has not been waited for.

    Attributes:
        step_id: the plan's ``step_id``.
        handle: the executor's own completion handle (a future, an event); opaque.
    """

    step_id: int
    handle: object


@attrs.frozen(slots=True, eq=False)
class TwoPhaseRun:
    """A step given to :meth:`OverlapExecutor.launch` in two phases: ``launch()`` queues
    its device work and returns without waiting for the tokens; the :data:`Finish` it
    returns waits for them and builds the result. Calling the record runs the whole step
    in one go (``run()``, which must equal ``launch()()``), so an executor that takes
    plain callables runs it unchanged.

    An executor that pipelines launches step ``k + 1`` before it finishes step ``k``
    when ``k + 1`` was launched to it before the caller waited for ``k`` and
    ``k + 1``'s ``pipelines`` allows it; results and exceptions stay per step, in launch
    order. A launch that raises fails its own step only (the step before still finishes).

    Attributes:
        run: the whole step at once.
        launch: queue the step; raises when the step failed before its tokens exist.
        pipelines: whether ``launch`` may run while the step before is launched but not
            finished (``False`` when it reads host results of that step).
    """

    run: Callable[[], StepResult]
    launch: Callable[[], Finish]
    pipelines: bool = True

    def __call__(self) -> StepResult:
        """The whole step at once: ``run()``."""
        return self.run()
