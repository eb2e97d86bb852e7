"""record_launches: wrap a ModelRunner's launch and finish to record the order they ran in
(the pipelining tests read it instead of timing)."""

from __future__ import annotations

from typing import Any

from deepinfer_kit.engine.runner.launched import LaunchedStep
from deepinfer_kit.engine.runner.model_runner import ModelRunner
from deepinfer_kit.step import StepResult


def record_launches(runner: ModelRunner) -> list[tuple[str, int]]:
    """Wrap ``runner``'s launch and finish; returns the list they append ``("L", step_id)``
    / ``("F", step_id)`` to, in the order they ran (on whatever thread runs them)."""
    order: list[tuple[str, int]] = []
    launch, finish = runner.launch, runner.finish
    ids: dict[int, int] = {}

    def recorded_launch(step: Any) -> LaunchedStep:
        order.append(("L", step.plan.step_id))
        launched = launch(step)
        ids[id(launched)] = step.plan.step_id
        return launched

    def recorded_finish(launched: LaunchedStep) -> StepResult:
        order.append(("F", ids.pop(id(launched))))
        return finish(launched)

    runner.launch = recorded_launch  # type: ignore[method-assign]
    runner.finish = recorded_finish  # type: ignore[method-assign]
    return order
