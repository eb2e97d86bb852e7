"""Fault injectors for engine tests: components that raise or poison logits on demand,
wrapped around the real ones so everything else runs as in production."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from deepinfer_kit import Engine
from deepinfer_kit.engine.runner import PreparedStep
from deepinfer_kit.outputs import RequestOutput
from deepinfer_kit.sched.records import SchedulePlan
from deepinfer_kit.step import StepResult


class InjectedFault(RuntimeError):
    """What the injectors raise."""


class PoisonModel:
    """Forwards to a real model; sets the logits of ``rows`` to NaN (or +inf)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.rows: list[int] = []
        self.value = float("nan")
        self.raise_next = False

    def __call__(self, batch: Any, kv_cache: Any) -> torch.Tensor:
        if self.raise_next:
            self.raise_next = False
            raise InjectedFault("forward failed")
        logits = self.inner(batch, kv_cache)
        if self.rows:
            logits = logits.clone()
            logits[self.rows] = self.value
        return logits

    def expert_counts(self) -> Any:
        return self.inner.expert_counts()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class RaisingSampler:
    """Forwards to a real sampler; raises while ``fail`` says so."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.fail: Callable[[], bool] = lambda: False

    def __call__(self, logits: torch.Tensor, batch: Any) -> Any:
        if self.fail():
            raise InjectedFault("sampler failed")
        return self.inner(logits, batch)


class RaisingScheduler:
    """Forwards to a real scheduler; ``commit`` raises (before changing anything) the
    first time it sees a plan whose step id ``fail_commit`` picks."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.fail_commit: Callable[[int], bool] = lambda step: False
        self._raised: set[int] = set()

    def commit(self, plan: SchedulePlan, result: StepResult) -> list[RequestOutput]:
        if plan.step_id not in self._raised and self.fail_commit(plan.step_id):
            self._raised.add(plan.step_id)
            raise InjectedFault("commit failed")
        return self.inner.commit(plan, result)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def rows_of(step: PreparedStep, request_ids: set[str]) -> list[int]:
    """The sampling rows of ``step`` that belong to ``request_ids``."""
    rows: list[int] = []
    row = 0
    for chunk, count in zip(step.plan.chunks, step.row_counts):
        if chunk.request_id in request_ids:
            rows.extend(range(row, row + count))
        row += count
    return rows


class FaultInjector:
    """Wires the injectors into ``engine`` and drives them from a seeded generator.

    Each step, with the given probabilities: the forward raises, the sampler raises, the
    commit raises, or random sampling rows get NaN logits. ``poisoned`` collects the
    sequences whose logits were poisoned.
    """

    def __init__(self, engine: Engine, seed: int, *, p_forward: float = 0.0,
                 p_sampler: float = 0.0, p_commit: float = 0.0, p_nan: float = 0.0) -> None:
        self.rng = random.Random(seed)
        runner = engine.runner
        self.model = PoisonModel(runner.model)
        runner.model = self.model  # type: ignore[assignment]
        self.sampler = RaisingSampler(runner.sampler)
        runner.sampler = self.sampler
        self.scheduler = RaisingScheduler(engine.scheduler)
        engine.scheduler = self.scheduler  # type: ignore[assignment]
        self.poisoned: set[str] = set()
        self.failed_steps: list[int] = []
        inner_prepare = runner.prepare

        def prepare(plan: SchedulePlan) -> PreparedStep:
            step = inner_prepare(plan)
            self.model.rows = []
            draw = self.rng.random()
            if draw < p_forward:
                self.model.raise_next = True
                self.failed_steps.append(plan.step_id)
            elif draw < p_forward + p_nan and plan.chunks:
                victims = {c.request_id for c in plan.chunks if c.sample and self.rng.random() < 0.3}
                self.model.rows = rows_of(step, victims)
                if self.model.rows:
                    self.poisoned |= {c.request_id for c in plan.chunks if c.request_id in victims}
            fail_sampler = self.rng.random() < p_sampler
            self.sampler.fail = lambda: fail_sampler
            if fail_sampler:
                self.failed_steps.append(plan.step_id)
            return step

        runner.prepare = prepare  # type: ignore[method-assign]
        p_c = p_commit
        self.scheduler.fail_commit = lambda step_id: self.rng.random() < p_c
