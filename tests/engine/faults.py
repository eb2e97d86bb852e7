"""Fault injectors for engine tests: components that raise or poison logits on demand,
wrapped around the real ones so everything else runs as in production."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from deepinfer_kit import Engine
from deepinfer_kit.engine.runner.model_runner import PreparedStep
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
    for chunk, count in zip(step.plan.all_chunks(), step.row_counts):
        if chunk.request_id in request_ids:
            rows.extend(range(row, row + count))
        row += count
    return rows


class RunnerFaults:
    """Installs the runner's injectors into a :class:`ModelRunner` and drives them from a
    seeded generator: picklable, so a worker process can install them in its own runner
    (``build_engine(worker="process", worker_setup=RunnerFaults(...))``).

    Each step, with the given probabilities: the forward raises, the sampler raises, or
    random sampling rows get NaN logits. ``poisoned`` collects the sequences whose logits
    were poisoned, ``failed_steps`` the steps made to raise (in the process that ran them).
    """

    def __init__(self, seed: int, *, p_forward: float = 0.0, p_sampler: float = 0.0,
                 p_nan: float = 0.0) -> None:
        self.seed, self.p_forward, self.p_sampler, self.p_nan = seed, p_forward, p_sampler, p_nan
        self.poisoned: set[str] = set()
        self.failed_steps: list[int] = []

    def __call__(self, runner: Any) -> None:
        rng = self.rng = random.Random(self.seed)
        self.model = model = PoisonModel(runner.model)
        runner.model = model
        self.sampler = sampler = RaisingSampler(runner.sampler)
        runner.sampler = sampler
        inner_prepare = runner.prepare
        p_forward, p_sampler, p_nan = self.p_forward, self.p_sampler, self.p_nan

        def prepare(plan: SchedulePlan, **kw: Any) -> PreparedStep:
            step = inner_prepare(plan, **kw)
            model.rows = []
            draw = rng.random()
            if draw < p_forward:
                model.raise_next = True
                self.failed_steps.append(plan.step_id)
            elif draw < p_forward + p_nan and plan.all_chunks():
                victims = {c.request_id for c in plan.all_chunks() if c.sample and rng.random() < 0.3}
                model.rows = rows_of(step, victims)
                if model.rows:
                    self.poisoned |= {c.request_id for c in plan.all_chunks() if c.request_id in victims}
            fail_sampler = rng.random() < p_sampler
            sampler.fail = lambda: fail_sampler
            if fail_sampler:
                self.failed_steps.append(plan.step_id)
            return step

        runner.prepare = prepare


def fail_commits(engine: Engine, seed: int, p_commit: float) -> RaisingScheduler:
    """Wrap ``engine``'s scheduler so that ``commit`` raises with probability ``p_commit``."""
    rng = random.Random(seed)
    scheduler = RaisingScheduler(engine.scheduler)
    engine.scheduler = scheduler  # type: ignore[assignment]
    scheduler.fail_commit = lambda step_id: rng.random() < p_commit
    return scheduler


def run_to_end(engine: Engine, reqs: list[tuple[str, Any, Any]]) -> tuple[dict[str, RequestOutput], list[str | None]]:
    """Add ``reqs`` (``(id, prompt, params)``), run ``engine`` dry and check every request
    came back; returns the outputs by id and every completion's finish reason, which the
    caller checks (an injected fault must show up as ``"error"``)."""
    for rid, prompt, params in reqs:
        engine.add_request(rid, prompt, params)
    outs = {o.request_id: o for o in engine.run()}
    assert set(outs) == {rid for rid, _, _ in reqs}
    reasons = [c.finish_reason for o in outs.values() for c in o.outputs]
    assert None not in reasons
    return outs, reasons


class FaultInjector:
    """Wires the injectors into ``engine`` (its runner in this process) and drives them
    from a seeded generator.

    Each step, with the given probabilities: the forward raises, the sampler raises, the
    commit raises, or random sampling rows get NaN logits. ``poisoned`` collects the
    sequences whose logits were poisoned.
    """

    def __init__(self, engine: Engine, seed: int, *, p_forward: float = 0.0,
                 p_sampler: float = 0.0, p_commit: float = 0.0, p_nan: float = 0.0) -> None:
        self.faults = RunnerFaults(seed, p_forward=p_forward, p_sampler=p_sampler, p_nan=p_nan)
        self.faults(engine.runner)
        self.rng = self.faults.rng
        self.model, self.sampler = self.faults.model, self.faults.sampler
        self.poisoned = self.faults.poisoned
        self.failed_steps = self.faults.failed_steps
        self.scheduler = RaisingScheduler(engine.scheduler)
        engine.scheduler = self.scheduler  # type: ignore[assignment]
        p_c = p_commit
        self.scheduler.fail_commit = lambda step_id: self.rng.random() < p_c
