"""A StepRunner whose ``token_slots`` cannot be released: mypy must reject it."""

from __future__ import annotations

from typing import Any

from deepinfer_kit.engine.protocols import StepRunner
from deepinfer_kit.sched.records import SchedulePlan
from deepinfer_kit.step import StepResult


class Slots:
    def check_all_free(self) -> None:
        pass


class ForgetfulRunner:
    block_size = 16
    num_blocks = 64
    token_slots: Slots | None = None  # no release_through

    def prepare(self, plan: SchedulePlan, *, record_expert_counts: bool = False) -> Any:
        return plan

    def check_idle(self) -> None:
        pass

    def execute(self, prepared: Any) -> StepResult:
        return StepResult(token_ids=[[0] for _ in prepared.chunks])

    def close(self) -> None:
        pass


_check: type[StepRunner] = ForgetfulRunner  # error: token_slots is not SlotLeases
