"""A round in flight: launching it, waiting for it and committing it — or failing the
whole round when its layout, launch, execution or commit raises."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import attrs

from deepinfer_kit.outputs import RequestOutput
from deepinfer_kit.overlap.protocols import OverlapExecutor
from deepinfer_kit.overlap.records import Finish, PendingStep, TwoPhaseRun
from deepinfer_kit.sched.protocols import Scheduler
from deepinfer_kit.sched.records import SchedulePlan
from deepinfer_kit.step import StepResult

if TYPE_CHECKING:
    from deepinfer_kit.engine.failures import StepFailures
    from deepinfer_kit.engine.protocols import StepRunner, TwoPhaseRunner

__all__ = ["InFlight", "failed_result", "launch_round", "commit_round", "two_phase_run"]


@attrs.define(slots=True, eq=False)
class InFlight:
    """A round scheduled and launched, not yet committed (with what its trace needs)."""

    plan: SchedulePlan
    launched: PendingStep | StepResult
    free_before: int
    evicted_before: int
    t0: float
    t1: float


def failed_result(plan: SchedulePlan, message: str) -> StepResult:
    """A result that fails every chunk of ``plan`` with ``message``."""
    n = plan.num_chunks
    return StepResult(token_ids=[[] for _ in range(n)], errors=[message] * n)


def launch_round(
    runner: StepRunner, executor: OverlapExecutor, failures: StepFailures, plan: SchedulePlan,
    record_expert_counts: bool = False, two_phase: TwoPhaseRunner | None = None,
) -> PendingStep | StepResult:
    """Lay ``plan`` out and start its device part on ``executor``; an empty plan, or one
    whose layout or launch raised (counted in ``failures``), is already its result.
    ``record_expert_counts``: the round returns its MoE routing counts (traces).
    ``two_phase`` (the runner itself, when overlapped and it can): the step goes to the
    executor as a :class:`TwoPhaseRun` (launch, then finish), else as one ``execute``.

    Raises:
        EngineDeadError: the failure was the last one ``failures`` allows in a row.
    """
    if plan.is_empty:
        return StepResult(token_ids=[])
    try:
        prepared = runner.prepare(plan, record_expert_counts=record_expert_counts)
        if two_phase is not None:
            run = two_phase_run(two_phase, prepared)
            return executor.launch(plan.step_id, run)
        return executor.launch(plan.step_id, lambda: runner.execute(prepared))
    except Exception as exc:
        failures.count(exc)
        return failed_result(plan, f"step {plan.step_id} failed: {exc!r}")


def two_phase_run(runner: TwoPhaseRunner, prepared: Any) -> TwoPhaseRun:
    """``prepared`` as a :class:`TwoPhaseRun`: ``runner.launch`` then ``runner.finish``,
    pipelined only where ``runner.pipelines`` allows; ``runner.execute`` when the
    executor runs it in one go."""

    def launch() -> Finish:
        launched = runner.launch(prepared)
        return lambda: runner.finish(launched)

    return TwoPhaseRun(lambda: runner.execute(prepared), launch, pipelines=runner.pipelines(prepared))


def commit_round(
    entry: InFlight, executor: OverlapExecutor, scheduler: Scheduler, failures: StepFailures
) -> tuple[StepResult, list[RequestOutput], float]:
    """Wait for ``entry``'s device work and commit it to ``scheduler``: returns the result
    committed, the outputs of the requests it finished and the ``perf_counter`` when the
    wait ended. A wait or commit that raises is counted in ``failures`` and the round's
    requests are failed instead (finish reason ``error``); a wait that succeeds ends the
    run of failures.

    Raises:
        EngineDeadError: too many failures in a row, or the scheduler could not even
            fail the round.
    """
    plan = entry.plan
    result = entry.launched
    if not isinstance(result, StepResult):
        try:
            result = executor.wait(result)
            failures.succeeded()
        except Exception as exc:
            failures.count(exc)
            result = failed_result(plan, f"step {plan.step_id} failed: {exc!r}")
    waited = time.perf_counter()
    try:
        return result, scheduler.commit(plan, result), waited
    except Exception as exc:
        failures.count(exc)
        try:
            failed = failed_result(plan, f"step {plan.step_id} commit failed: {exc!r}")
            return failed_result(plan, ""), scheduler.commit(plan, failed), waited
        except Exception as again:
            raise failures.die(f"the scheduler could not fail step {plan.step_id}", again) from exc
