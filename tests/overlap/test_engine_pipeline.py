"""The overlapped engine on a pipelining executor: the runner launches round k + 1 before it
finishes round k (its tokens reach k + 1 through the token slots on the device), and the
outputs equal the synchronous engine's token for token. Whether a round was pipelined is
read from a recorded order of the runner's launches and finishes, fixed by the engine's
calls (it launches k + 1 before it waits for k), never by timing."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from differential import run_workload, workload

from launch_order import record_launches

from deepinfer_kit import Components, Engine, SamplingParams, build_engine
from deepinfer_kit.engine.runner.launched import LaunchedStep
from deepinfer_kit.engine.runner.model_runner import ModelRunner
from deepinfer_kit.overlap import ThreadExecutor
from deepinfer_kit.step import StepResult

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from faults import PoisonModel

ROOMY = {"num_blocks": 200, "block_size": 8, "max_model_len": 96, "max_num_seqs": 16,
         "max_num_batched_tokens": 96}
SMALL_POOL = {"num_blocks": 20, "block_size": 8, "max_model_len": 96, "max_num_seqs": 8,
              "max_num_batched_tokens": 64, "long_prefill_token_threshold": 24}


def _pipelined(pipeline: bool = True, **config: Any) -> Engine:
    return build_engine(overlap=True, components=Components(executor=ThreadExecutor(depth=1, pipeline=pipeline)), **config)


def _record(engine: Engine) -> list[tuple[str, int]]:
    """Wrap the runner's launch and finish: ``("L", step_id)`` / ``("F", step_id)`` in the
    order they ran (on the worker thread)."""
    runner = engine.runner
    assert isinstance(runner, ModelRunner)
    return record_launches(runner)


def _pipelined_pairs(order: list[tuple[str, int]]) -> list[int]:
    """Steps ``k`` whose successor was launched before ``k`` finished."""
    at = {event: i for i, event in enumerate(order)}
    return [k for op, k in order if op == "F" and ("L", k + 1) in at and at[("L", k + 1)] < at[("F", k)]]


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("config", [ROOMY, SMALL_POOL], ids=["roomy", "preempting"])
@pytest.mark.parametrize("seed", [0, 1])
def test_pipelined_engine_equals_sync_token_for_token(seed: int, config: dict[str, Any], static: bool) -> None:
    """The differential workload: greedy, seeded sampling, penalties and min_tokens that
    read the in-flight token, forks, logprobs, frequent stop ids, prefix hits, chunked
    prefill and (small pool) preemption."""
    reqs = workload(seed, 30)
    want, _ = run_workload(reqs, False, static_decode=static, **config)
    engine = _pipelined(static_decode=static, **config)
    order = _record(engine)
    got, _ = run_workload(reqs, engine=engine)
    assert got == want
    assert _pipelined_pairs(order), "no round was launched before the one before it finished"
    executor = engine.executor
    assert isinstance(executor, ThreadExecutor) and executor.num_pipelined == len(_pipelined_pairs(order))
    engine.close()


def test_every_round_pipelines_unless_it_reads_the_in_flight_token_on_the_host() -> None:
    """Greedy requests: every round after the first is launched before the one before it
    finished. Add a request with penalties: its rounds (placeholder rows that need the
    host history) wait for the round before."""
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine = _pipelined(**ROOMY)
    order = _record(engine)
    engine.add_request("a", [1, 2, 3], greedy)
    engine.add_request("b", [4, 5], greedy)
    engine.run()
    steps = sorted({k for _, k in order})
    assert _pipelined_pairs(order) == steps[:-1]

    engine = _pipelined(**ROOMY)
    order = _record(engine)
    engine.add_request("a", [1, 2, 3], greedy)
    engine.add_request("p", [4, 5], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                   presence_penalty=0.5))
    engine.run()
    assert _pipelined_pairs(order) == [], order
    engine.check_idle()


def test_the_default_cpu_executor_does_not_pipeline() -> None:
    """On CPU a launch is the whole forward: the default executor runs each round to the
    end (the host commits round k while round k + 1 computes, as before)."""
    engine = build_engine(overlap=True, **ROOMY)
    order = _record(engine)
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.run()
    assert order and _pipelined_pairs(order) == []


def _fail_steps(engine: Engine, in_launch: set[int], in_finish: set[int]) -> list[tuple[str, int]]:
    """Make the forward of the rounds ``in_launch`` raise (inside the runner's launch,
    after the placeholders were gathered) and the finish of the rounds ``in_finish``
    raise (after their tokens were published to the slots); returns the recorded order
    of launches and finishes (as :func:`_record`)."""
    runner = engine.runner
    assert isinstance(runner, ModelRunner)
    model = PoisonModel(runner.model)
    runner.model = model
    if runner.static is not None:
        runner.static.model = model
    order = _record(engine)
    launch, finish = runner.launch, runner.finish
    ids: dict[int, int] = {}

    def failing_launch(step: Any) -> LaunchedStep:
        model.raise_next = step.plan.step_id in in_launch
        launched = launch(step)
        ids[id(launched)] = step.plan.step_id
        return launched

    def failing_finish(launched: LaunchedStep) -> StepResult:
        result = finish(launched)
        if ids.pop(id(launched)) in in_finish:
            raise RuntimeError("finish failed")
        return result

    runner.launch = failing_launch  # type: ignore[method-assign]
    runner.finish = failing_finish  # type: ignore[method-assign]
    return order


@pytest.mark.parametrize("seed", [0, 3])
def test_failed_rounds_fail_the_same_requests_pipelined_or_not(seed: int) -> None:
    """Rounds whose forward raises and rounds whose finish raises (after round k + 1 was
    already launched from their slots): the pipelined engine ends exactly the same
    requests with ``error``, and gives the others the same tokens, as the overlapped
    engine that runs each round to the end. No request reads its history (penalties), so
    every round may pipeline, the failing ones included."""
    reqs = [r for r in workload(seed, 36) if r[2].presence_penalty == 0 and not r[2].min_tokens]
    in_launch, in_finish = {4, 11}, {7, 15}
    outcomes = []
    for pipeline in (False, True):
        engine = _pipelined(pipeline, **SMALL_POOL)
        order = _fail_steps(engine, in_launch, in_finish)
        got, _ = run_workload(reqs, engine=engine)
        outcomes.append(got)
        engine.close()
    assert outcomes[0] == outcomes[1]
    pipelined = set(_pipelined_pairs(order))
    assert pipelined & in_finish and pipelined & {k - 1 for k in in_launch}, (sorted(pipelined), order)
    reasons = [c[1] for comps in outcomes[1].values() for c in comps]
    assert "error" in reasons and {"stop", "length"} & set(reasons), reasons


def test_speculative_rounds_are_never_pipelined_and_equal_sync() -> None:
    """Each speculative round resolves against the round before on the host (a LateStep
    runs whole in its launch): the pipelining executor finishes round k first, and the
    outputs equal the synchronous speculative engine's."""
    spec = {"drafter": "ngram", "num_draft": 3}
    reqs = workload(5, 16)
    want, _ = run_workload(reqs, False, speculative=spec, **ROOMY)
    engine = _pipelined(speculative=spec, **ROOMY)
    got, _ = run_workload(reqs, engine=engine)
    assert got == want
    executor = engine.executor
    assert isinstance(executor, ThreadExecutor) and executor.num_pipelined == 0
    engine.close()


@pytest.mark.cuda
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_pipelined_cuda_engine_equals_sync(graphs: bool) -> None:
    """On a GPU the default overlapped executor (CudaStreamExecutor) pipelines: the same
    tokens as the synchronous engine on the same device, and rounds really were launched
    before the round before finished (pinned copies, events, the stream's order)."""
    config = {**ROOMY, "device": "cuda", "cuda_graphs": graphs}
    reqs = workload(0, 30)
    want, _ = run_workload(reqs, False, **config)
    engine = build_engine(overlap=True, **config)
    order = _record(engine)
    got, _ = run_workload(reqs, engine=engine)
    assert got == want
    assert _pipelined_pairs(order)
    engine.close()
