"""Device-resident token rows under the overlapped engine: placeholders are gathered from
the sequences' token slots on the device, slots churn without ever landing on a live
sequence, and a row whose previous token was never sampled is reported, never fed."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer_kit import Engine, SamplingParams, build_engine
from deepinfer_kit.engine.runner.model_runner import PreparedStep
from deepinfer_kit.step import StepResult
from differential import run_workload

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from faults import PoisonModel  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CONFIG = {"num_blocks": 64, "block_size": 4, "max_model_len": 64}


def _spy(engine: Engine, before: Any = None, after: Any = None) -> dict[int, tuple[PreparedStep, StepResult]]:
    """Wrap the runner's execute: ``before(step)`` / ``after(step)`` around it; returns
    ``step_id -> (step, result)`` filled as steps run."""
    seen: dict[int, tuple[PreparedStep, StepResult]] = {}
    inner = engine.runner.execute

    def execute(step: PreparedStep) -> StepResult:
        if before is not None:
            before(step)
        result = inner(step)
        if after is not None:
            after(step)
        seen[step.plan.step_id] = (step, result)
        return result

    engine.runner.execute = execute  # type: ignore[method-assign]
    return seen


class _InputSpy(PoisonModel):
    """Records each forward's input ids under the step id set before it."""

    def __init__(self, inner: Any, fed: dict[int, list[int]]) -> None:
        super().__init__(inner)
        self.fed, self.step_id = fed, -1

    def __call__(self, batch: Any, kv_cache: Any) -> torch.Tensor:
        self.fed[self.step_id] = batch.input_ids.tolist()
        return self.inner(batch, kv_cache)


def test_slot_churn_next_to_a_long_request_equals_sync() -> None:
    """A ring (or an early release) of slots wraps onto the long request's slot while
    short requests come and go every step: tokens of the long one would change. Capacity
    is exactly ``2 * max_num_seqs``."""
    reqs = [("long", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))]
    reqs += [(f"s{i}", [10 + i, 3], SamplingParams(temperature=0.8, seed=i, max_tokens=1 + i % 3,
                                                   ignore_eos=True)) for i in range(30)]
    config = {**CONFIG, "max_num_seqs": 3}
    sync, _ = run_workload(reqs, overlap=False, **config)
    over, engine = run_workload(reqs, overlap=True, **config)
    slots = engine.runner.token_slots
    assert slots is not None and slots.capacity == 6 and slots.num_free == 6
    assert over == sync


def test_the_forward_reads_the_placeholder_from_the_device_slot() -> None:
    """Overwrite a's slot on the device after step 2 ran: step 3's forward must see the
    new value in a's hole (the host never supplies placeholder inputs)."""
    engine = build_engine(overlap=True, **CONFIG)
    slots = engine.runner.token_slots
    assert slots is not None
    fed: dict[int, list[int]] = {}
    spy = _InputSpy(engine.runner.model, fed)
    engine.runner.model = spy

    def poke(step: PreparedStep) -> None:
        if step.plan.step_id == 2:
            slot = slots.slot_of(step.plan.all_chunks()[0].request_id)
            assert slot is not None
            slots.tokens[slot] = 7

    seen = _spy(engine, lambda step: setattr(spy, "step_id", step.plan.step_id), poke)
    engine.add_request("a", [1, 2, 3], GREEDY)
    engine.add_request("b", [4, 5, 6], GREEDY)
    engine.run()
    step3, _ = seen[3]
    assert step3.routes.hole_inputs == [0, 1]  # both decode from a placeholder
    assert fed[3][0] == 7 and fed[3][1] != 7
    engine.check_idle()


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_a_row_that_was_never_sampled_is_reported_not_fed(static: bool) -> None:
    """a's row is NaN in step 2; step 3 was scheduled with a placeholder for it: that
    chunk is an error (the slot says never sampled), b continues untouched."""
    engine = build_engine(overlap=True, static_decode=static, **CONFIG)
    poison = PoisonModel(engine.runner.model)
    engine.runner.model = poison
    if engine.runner.static is not None:
        engine.runner.static.model = poison

    def arm(step: PreparedStep) -> None:
        poison.rows = [0] if step.plan.step_id == 2 else []

    seen = _spy(engine, arm)
    engine.add_request("a", [1, 2, 3], GREEDY)
    engine.add_request("b", [4, 5, 6], GREEDY)
    outs = {o.request_id: o.outputs[0] for o in engine.run()}
    step3, result3 = seen[3]
    assert (step3.staged is not None) == static
    assert result3.errors[0] == "the in-flight token this step continues from was never sampled"
    assert result3.errors[1] is None and result3.token_ids[1]
    assert outs["a"].finish_reason == "error" and "non-finite" in (outs["a"].stop_reason or "")
    assert outs["b"].finish_reason == "length" and len(outs["b"].token_ids) == 8
    engine.check_idle()


def test_a_failed_step_leaves_its_slots_unsampled() -> None:
    """The forward of step 2 raises after its placeholders were gathered: the slots it
    would have written say never sampled, so step 3's placeholders are errors, not the
    stale tokens of step 1."""
    engine = build_engine(overlap=True, **CONFIG)
    poison = PoisonModel(engine.runner.model)
    engine.runner.model = poison

    def arm(step: PreparedStep) -> None:
        poison.raise_next = step.plan.step_id == 2

    seen = _spy(engine, arm)
    engine.add_request("a", [1, 2, 3], GREEDY)
    outs = {o.request_id: o.outputs[0] for o in engine.run()}
    assert 2 not in seen  # it raised
    _, result3 = seen[3]
    assert result3.errors == ["the in-flight token this step continues from was never sampled"]
    assert outs["a"].finish_reason == "error"
    engine.check_idle()


def test_an_overlapped_executor_needs_token_slots_and_idle_means_all_free() -> None:
    from deepinfer_kit import Engine as EngineClass
    from deepinfer_kit.errors import ConfigError, InvariantError
    from deepinfer_kit.overlap import ThreadExecutor

    sync = build_engine(overlap=False, **CONFIG)
    assert sync.runner.token_slots is None  # the synchronous engine writes no slots
    parts = {"runner": sync.runner, "scheduler": sync.scheduler, "cache": sync.cache,
             "tokenizer": None, "vocab_size": sync.vocab_size, "eos_token_id": None}
    executor = ThreadExecutor()
    with pytest.raises(ConfigError, match="token_slots"):
        EngineClass(**parts, executor=executor)
    executor.close()
    over = build_engine(overlap=True, **CONFIG)
    slots = over.runner.token_slots
    assert slots is not None
    slots.lease("ghost", 0)
    with pytest.raises(InvariantError, match="1 token slots still leased"):
        over.check_idle()
