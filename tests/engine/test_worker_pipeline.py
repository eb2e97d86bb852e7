"""The process worker's loop pipelines: a step already received when the one before was
launched is launched before that one is finished and answered (where the runner allows
it), and the replies carry the same tokens, in the same order, as an in-process engine's
steps. The loop runs here in this process over a pipe whose messages were all sent before
it started, so which steps pipeline is fixed by the messages, not by timing."""

from __future__ import annotations

import pickle
from multiprocessing import Pipe
from typing import Any

import pytest

from launch_order import record_launches

from deepinfer_kit import SamplingParams, build_engine
from deepinfer_kit.engine.remote.plan_codec import PlanEncoder
from deepinfer_kit.engine.remote.worker_main import _loop
from deepinfer_kit.engine.runner.model_runner import ModelRunner
from deepinfer_kit.sched.records import SchedulePlan
from deepinfer_kit.step import StepResult

CONFIG = {"num_blocks": 64, "block_size": 4, "max_model_len": 64, "max_num_seqs": 4}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _served_steps() -> list[tuple[SchedulePlan, int | None, StepResult]]:
    """An in-process overlapped engine's steps: each plan, the newest step committed when
    it was prepared (the release stamp a worker gets with it) and its result."""
    engine = build_engine(overlap=True, **CONFIG)
    runner = engine.runner
    assert isinstance(runner, ModelRunner) and runner.token_slots is not None
    slots = runner.token_slots
    steps: dict[int, list[Any]] = {}
    released: list[int | None] = [None]
    prepare, execute, release = runner.prepare, runner.execute, slots.release_through

    def recorded_prepare(plan: SchedulePlan, **kw: Any) -> Any:
        steps[plan.step_id] = [plan, released[-1], None]
        return prepare(plan, **kw)

    def recorded_execute(step: Any) -> StepResult:
        result = execute(step)
        steps[step.plan.step_id][2] = result
        return result

    def recorded_release(step_id: int) -> list[int]:
        released.append(step_id)
        return release(step_id)

    runner.prepare = recorded_prepare  # type: ignore[method-assign]
    runner.execute = recorded_execute  # type: ignore[method-assign]
    slots.release_through = recorded_release  # type: ignore[method-assign]
    engine.add_request("a", [1, 2, 3], GREEDY)
    engine.add_request("b", [7, 8], SamplingParams(temperature=0.9, seed=5, max_tokens=5, ignore_eos=True))
    engine.add_request("p", [4, 5], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                                   presence_penalty=0.5))
    engine.run()
    engine.check_idle()
    return [(plan, stamp, result) for plan, stamp, result in (steps[k] for k in sorted(steps))]


def _serve_in_loop(steps: list[tuple[SchedulePlan, int | None, StepResult]], pipeline: bool
                   ) -> tuple[list[tuple[str, int, Any]], list[tuple[str, int]]]:
    """Send every step (then ``close``) down a pipe, run the worker's loop over a fresh
    runner until it returns; its replies and the order of its launches and finishes."""
    runner = build_engine(overlap=True, **CONFIG).runner
    assert isinstance(runner, ModelRunner)
    order = record_launches(runner)
    host, worker = Pipe()
    encoder = PlanEncoder()
    for plan, stamp, _ in steps:
        number, data = encoder.encode(plan)
        encoder.confirm(number)
        host.send_bytes(pickle.dumps(("step", number, stamp, False, data)))
    host.send_bytes(pickle.dumps(("close",)))
    _loop(worker, runner, None, pipeline=pipeline)
    replies = []
    while host.poll(0):
        replies.append(pickle.loads(host.recv_bytes()))
    return replies, order


@pytest.mark.parametrize("pipeline", [True, False])
def test_the_worker_loop_pipelines_and_answers_in_order(pipeline: bool) -> None:
    steps = _served_steps()
    replies, order = _serve_in_loop(steps, pipeline)
    assert [kind for kind, _, _ in replies] == ["ok"] * len(steps)
    assert [r.token_ids for _, _, r in replies] == [result.token_ids for _, _, result in steps]
    assert [number for _, number, _ in replies] == sorted(number for _, number, _ in replies)
    at = {event: i for i, event in enumerate(order)}
    pipelined = [k for op, k in order if op == "F" and ("L", k + 1) in at and at[("L", k + 1)] < at[("F", k)]]
    history = {plan.step_id for plan, _, _ in steps
               if any(c.request_id == "p" and c.num_placeholders for c in plan.chunks)}
    assert history, "no step read the penalised request's in-flight token"
    if pipeline:
        # every step is pipelined except the last and those before a step that needs the
        # host history of the in-flight token (the penalised request's decodes)
        want = [plan.step_id for plan, _, _ in steps[:-1] if plan.step_id + 1 not in history]
        assert pipelined == want, order
    else:
        assert pipelined == []
