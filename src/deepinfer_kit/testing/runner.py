"""Conformance suite for StepRunner: every check serves a small seeded workload through an
:class:`~deepinfer_kit.engine.engine.Engine` around the runner your factory builds, and
compares it with the reference :class:`~deepinfer_kit.engine.runner.model_runner.ModelRunner` on the
same model.

The factory is ``factory(config, depth) -> StepRunner``: a runner for the model of
``config`` (an :class:`EngineConfig` naming the embedded ``"tiny"`` model and a small KV
pool) under an executor of ``depth`` (1: it must keep token slots for placeholders).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.engine.engine import Engine
from deepinfer_kit.engine.host import build_host_components
from deepinfer_kit.engine.protocols import StepRunner
from deepinfer_kit.engine.runner.build import build_device
from deepinfer_kit.errors import InvariantError
from deepinfer_kit.models.tokenizer import ByteTokenizer
from deepinfer_kit.overlap.deferred import DeferredExecutor
from deepinfer_kit.overlap.threaded import ThreadExecutor
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sched.records import ScheduledChunk, SchedulePlan
from deepinfer_kit.testing.suite import Suite, expect

__all__ = ["RunnerFactory", "STEP_RUNNER_SUITE", "reference_runner"]

RunnerFactory = Callable[[EngineConfig, int], StepRunner]
"""``factory(config, depth)`` -> a runner for ``config``'s model."""

STEP_RUNNER_SUITE: Suite[RunnerFactory] = Suite("StepRunner", "factory(config, depth) -> StepRunner")

_CONFIG = EngineConfig(model="tiny", num_blocks=24, block_size=8, max_model_len=96, max_num_seqs=8,
                       max_num_batched_tokens=64, long_prefill_token_threshold=24)
_TOKENS = ByteTokenizer()  # the tiny model's vocabulary


def reference_runner(config: EngineConfig, depth: int) -> StepRunner:
    """The in-process :class:`ModelRunner` of ``config`` (the suite's oracle)."""
    return build_device(config, depth=depth).runner


def _engine(runner: StepRunner, config: EngineConfig, depth: int, threaded: bool = False) -> Engine:
    scheduler, cache = build_host_components(config, num_blocks=runner.num_blocks,
                                             max_model_len=config.max_model_len or 96)
    executor = None if not depth else (ThreadExecutor(1) if threaded else DeferredExecutor(1))
    return Engine(runner=runner, scheduler=scheduler, cache=cache, tokenizer=None,
                  vocab_size=_TOKENS.vocab_size, eos_token_id=_TOKENS.eos_token_id, executor=executor)


def _workload(seed: int) -> list[tuple[str, list[int], SamplingParams]]:
    """Greedy, penalties with ``min_tokens``, forks, top-p with logprobs, prefix hits."""
    rng = random.Random(seed)
    reqs = []
    for i in range(14):
        kind, most, seed_i = rng.random(), rng.randint(1, 10), 100 + i
        if kind < 0.35:
            params = SamplingParams(temperature=0.0, max_tokens=most)
        elif kind < 0.55:
            params = SamplingParams(temperature=0.9, repetition_penalty=1.2, presence_penalty=0.5,
                                    min_tokens=1, max_tokens=most, seed=seed_i)
        elif kind < 0.7:
            params = SamplingParams(temperature=1.0, n=2, top_k=30, max_tokens=most, seed=seed_i)
        else:
            params = SamplingParams(temperature=0.8, top_p=0.9, logprobs=2, max_tokens=most, seed=seed_i)
        prompt = [rng.randrange(1, 250) for _ in range(rng.randint(1, 40))]
        if i % 3 == 0:
            prompt = [9] * 17 + prompt[:5]  # prefix hits
        reqs.append((f"r{i}", prompt, params))
    return reqs


_Outcome = dict[str, list[tuple[tuple[int, ...], "str | None", "list[list[int]] | None"]]]


def _serve(engine: Engine, seed: int) -> _Outcome:
    for rid, prompt, params in _workload(seed):
        engine.add_request(rid, prompt, params)
    got: _Outcome = {}
    for out in engine.run():
        got[out.request_id] = [
            (tuple(c.token_ids), c.finish_reason,
             [sorted(lp) for lp in c.logprobs] if c.logprobs is not None else None)
            for c in out.outputs
        ]
    engine.check_idle()
    return got


def _close(runner: StepRunner) -> None:
    runner.close()


@STEP_RUNNER_SUITE.check
def check_serves_the_reference_tokens(factory: RunnerFactory) -> None:
    want = _serve(_engine(reference_runner(_CONFIG, 0), _CONFIG, 0), 0)
    runner = factory(_CONFIG, 0)
    try:
        expect((runner.block_size, runner.num_blocks) == (_CONFIG.block_size, _CONFIG.num_blocks),
               f"pool: {runner.num_blocks} blocks of {runner.block_size}, config asked "
               f"{_CONFIG.num_blocks} of {_CONFIG.block_size}")
        got = _serve(_engine(runner, _CONFIG, 0), 0)
    finally:
        _close(runner)
    expect(got == want, "tokens, finish reasons or logprob keys differ from ModelRunner's: "
           + ", ".join(sorted(r for r in want if got.get(r) != want[r])))


@STEP_RUNNER_SUITE.check
def check_overlapped_it_resolves_placeholders(factory: RunnerFactory) -> None:
    """At depth 1 (plans with placeholders, committed one step late) the outputs are the
    synchronous reference's; its token slots end free (the engine's idle check)."""
    want = _serve(_engine(reference_runner(_CONFIG, 0), _CONFIG, 0), 1)
    for threaded in (False, True):
        runner = factory(_CONFIG, 1)
        try:
            expect(runner.token_slots is not None, "a runner built for depth 1 must have token slots")
            got = _serve(_engine(runner, _CONFIG, 1, threaded), 1)
        finally:
            _close(runner)
        executor = "ThreadExecutor" if threaded else "DeferredExecutor"
        expect(got == want, f"overlapped ({executor}) outputs differ from the synchronous reference: "
               + ", ".join(sorted(r for r in want if got.get(r) != want[r])))


@STEP_RUNNER_SUITE.check
def check_a_broken_plan_fails_alone(factory: RunnerFactory) -> None:
    """A plan breaking the contract (a placeholder with no token slots) raises from
    ``prepare`` or ``execute``; the runner then serves the next plan."""
    runner = factory(_CONFIG, 0)
    try:
        bad = SchedulePlan(0, [ScheduledChunk("x", 0, 1, [], [0], num_placeholders=1)])
        try:
            runner.execute(runner.prepare(bad))
        except InvariantError:
            pass
        else:
            raise AssertionError("a placeholder without token slots must raise InvariantError")
        got = _serve(_engine(runner, _CONFIG, 0), 2)
    finally:
        _close(runner)
    want = _serve(_engine(reference_runner(_CONFIG, 0), _CONFIG, 0), 2)
    expect(got == want, "after a failed plan the runner's outputs differ from the reference's")
