"""One bad request or one failed step never poisons the engine: non-finite logits end
only their row's request, a failed step ends only its requests, a component that keeps
failing surfaces as one EngineDeadError; bad inputs are refused with named errors."""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest
import torch
from faults import FaultInjector, InjectedFault, PoisonModel, RaisingSampler, rows_of

from deepinfer_kit import ConfigError, Engine, EngineDeadError, SamplingParams, build_engine
from deepinfer_kit.engine.runner.model_runner import PreparedStep
from deepinfer_kit.sched.records import SchedulePlan

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _engine(**config: object) -> Engine:
    config.setdefault("num_blocks", 64)
    config.setdefault("block_size", 8)
    config.setdefault("max_model_len", 256)
    return build_engine(**config)  # type: ignore[arg-type]


def _run(engine: Engine) -> dict[str, object]:
    outs = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
        steps += 1
        assert steps < 5000, "the engine must not hang"
    for out in engine.flush():
        outs[out.request_id] = out
    return outs  # type: ignore[return-value]


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_non_finite_logits_end_only_that_request(value: float, temperature: float) -> None:
    engine = _engine(overlap=False)  # arms the poison in prepare: the next execute is its step
    model = PoisonModel(engine.runner.model)
    engine.runner.model = model  # type: ignore[assignment]
    model.value = value
    inner_prepare = engine.runner.prepare

    def prepare(plan: SchedulePlan, **kw: Any) -> PreparedStep:
        step = inner_prepare(plan, **kw)
        decoding = any(c.request_id == "bad" and not c.is_prefill for c in plan.all_chunks())
        model.rows = rows_of(step, {"bad"}) if decoding else []
        return step

    engine.runner.prepare = prepare  # type: ignore[method-assign]
    params = SamplingParams(temperature=temperature, max_tokens=6, ignore_eos=True, seed=3)
    for rid in ("good-1", "bad", "good-2"):
        engine.add_request(rid, [5, 6, 7, 8, 9], params)
    outs = _run(engine)
    bad = outs["bad"].outputs[0]  # type: ignore[attr-defined]
    assert bad.finish_reason == "error"
    assert "non-finite logits" in str(bad.stop_reason) and "position 1" in str(bad.stop_reason)
    assert len(bad.token_ids) == 1  # the token sampled before the poisoned row stays
    for rid in ("good-1", "good-2"):
        good = outs[rid].outputs[0]  # type: ignore[attr-defined]
        assert good.finish_reason == "length" and len(good.token_ids) == 6
        assert all(0 <= t < engine.vocab_size for t in good.token_ids)
    engine.check_idle()


def test_nan_weights_fail_every_request_with_a_named_error_and_the_engine_recovers() -> None:
    engine = _engine()
    norm = engine.runner.model.norm.weight  # type: ignore[attr-defined]
    saved = norm.detach().clone()
    with torch.no_grad():
        norm[0] = float("nan")
    for i in range(3):
        engine.add_request(f"r{i}", [1 + i, 2, 3], SamplingParams(temperature=1.0, max_tokens=4))
    outs = _run(engine)
    for out in outs.values():
        comp = out.outputs[0]  # type: ignore[attr-defined]
        assert comp.finish_reason == "error" and comp.token_ids == []
        assert "non-finite logits" in str(comp.stop_reason)
    engine.check_idle()
    with torch.no_grad():
        norm.copy_(saved)
    engine.add_request("after", [1, 2, 3], GREEDY)
    (out,) = engine.run()
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 6
    engine.check_idle()


def test_a_failed_step_ends_exactly_its_requests_and_the_engine_goes_on() -> None:
    engine = _engine(max_num_seqs=2)
    sampler = RaisingSampler(engine.runner.sampler)
    engine.runner.sampler = sampler
    calls = iter(range(1000))
    sampler.fail = lambda: next(calls) == 2  # the third sampling call raises
    for rid in ("a", "b", "c", "d"):
        engine.add_request(rid, [3, 4, 5], GREEDY)
    outs = _run(engine)
    failed = {rid for rid, o in outs.items() if o.outputs[0].finish_reason == "error"}  # type: ignore[attr-defined]
    assert failed == {"a", "b"}, failed  # the two running when it failed; c, d ran after
    for rid in failed:
        assert "sampler failed" in str(outs[rid].outputs[0].stop_reason)  # type: ignore[attr-defined]
    for rid in ("c", "d"):
        assert outs[rid].outputs[0].finish_reason == "length"  # type: ignore[attr-defined]
    engine.check_idle()
    engine.add_request("a", [3, 4, 5], GREEDY)  # ids and blocks are free again
    assert engine.run()[0].outputs[0].finish_reason == "length"
    engine.check_idle()


def test_a_component_that_keeps_failing_is_one_engine_dead_error() -> None:
    engine = _engine(max_num_seqs=1)
    sampler = RaisingSampler(engine.runner.sampler)
    engine.runner.sampler = sampler
    sampler.fail = lambda: True
    for i in range(20):
        engine.add_request(f"r{i}", [3, 4, 5], GREEDY)
    with pytest.raises(EngineDeadError, match="8 steps in a row failed") as info:
        for _ in range(100):
            engine.step()
    assert isinstance(info.value.__cause__, InjectedFault)
    for call in (engine.step, engine.flush, lambda: engine.add_request(None, [1], GREEDY)):
        with pytest.raises(EngineDeadError):
            call()


@pytest.mark.parametrize("overlap", [False, True])
def test_failures_separated_by_successful_steps_never_kill_the_engine(overlap: bool) -> None:
    """Seven failed steps in a row, then a good one, over and over (56 failures in all):
    the count starts again at every success, so the engine serves to the end; then eight
    in a row kill it."""
    engine = _engine(max_num_seqs=1, overlap=overlap)
    sampler = RaisingSampler(engine.runner.sampler)
    engine.runner.sampler = sampler
    calls = iter(range(100_000))
    sampler.fail = lambda: next(calls) % 8 != 7  # 7 failures, 1 success, ...
    for i in range(64):
        engine.add_request(f"r{i}", [3, 4, 5], SamplingParams(temperature=0.0, max_tokens=1))
    outs = _run(engine)
    reasons = [outs[f"r{i}"].outputs[0].finish_reason for i in range(64)]  # type: ignore[attr-defined]
    assert reasons.count("error") >= 56 and reasons.count("length") >= 7, reasons
    engine.check_idle()
    sampler.fail = lambda: True
    for i in range(9):
        engine.add_request(f"x{i}", [3, 4, 5], GREEDY)
    with pytest.raises(EngineDeadError, match="8 steps in a row failed"):
        for _ in range(100):
            engine.step()


def test_a_scheduler_that_cannot_plan_kills_the_engine_clearly() -> None:
    engine = _engine()
    engine.add_request("a", [1, 2], GREEDY)

    def broken() -> SchedulePlan:
        raise InjectedFault("bad plan")

    engine.scheduler.schedule = broken  # type: ignore[method-assign]
    with pytest.raises(EngineDeadError, match="scheduler failed to plan"):
        engine.step()
    with pytest.raises(EngineDeadError):
        engine.step()


@pytest.mark.parametrize("priority", ["x", float("nan"), 1.5, None, True])
def test_priority_must_be_an_int(priority: object) -> None:
    engine = _engine(scheduler_policy="priority")
    with pytest.raises(ConfigError, match="priority must be an int"):
        engine.add_request("bad", [1, 2, 3], GREEDY, priority=priority)  # type: ignore[arg-type]
    engine.add_request("good", [1, 2, 3], GREEDY, priority=2)
    (out,) = engine.run()
    assert out.request_id == "good" and out.outputs[0].finish_reason == "length"
    engine.check_idle()


def test_an_id_is_reusable_right_after_abort() -> None:
    engine = _engine()
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    engine.step()
    assert engine.abort("a")
    engine.add_request("a", [4, 5, 6], GREEDY)  # the scheduler has not reported the abort yet
    outs = engine.run()
    reasons = sorted((o.request_id, o.outputs[0].finish_reason) for o in outs)
    assert reasons == [("a", "abort"), ("a", "length")]
    fresh = next(o for o in outs if o.outputs[0].finish_reason == "length")
    assert fresh.prompt_token_ids == [4, 5, 6] and len(fresh.outputs[0].token_ids) == 6
    engine.check_idle()


def test_automatic_ids_never_collide_with_user_ids() -> None:
    engine = _engine()
    engine.add_request("req-0", [1, 2], GREEDY)
    auto = engine.add_request(None, [1, 2], GREEDY)
    assert auto != "req-0"
    assert {o.request_id for o in engine.run()} == {"req-0", auto}


def test_logprobs_are_capped() -> None:
    engine = _engine()
    with pytest.raises(ConfigError, match=r"logprobs must be <= max_logprobs \(20\), got 21"):
        engine.add_request("x", [1, 2], SamplingParams(logprobs=21))
    engine.add_request("ok", [1, 2], SamplingParams(temperature=0.0, max_tokens=2, logprobs=20))
    (out,) = engine.run()
    assert all(len(lp) <= 21 for lp in out.outputs[0].logprobs or [])


def test_never_fitting_requests_are_refused_at_the_edge() -> None:
    engine = _engine(num_blocks=4, block_size=8, max_model_len=32)
    with pytest.raises(ConfigError, match="must be shorter than max_model_len=32"):
        engine.add_request("long", [1] * 32, GREEDY)
    engine = _engine(num_blocks=4, block_size=8, max_model_len=32, scheduler="static")
    with pytest.raises(ConfigError, match="n=2 completions of up to 31 tokens need 8 KV blocks"):
        engine.add_request("fork", list(range(1, 28)), SamplingParams(n=2, temperature=1.0))
    with pytest.raises(ConfigError, match="n=3 completions exceed max_num_seqs=2"):
        _engine(max_num_seqs=2).add_request("n", [1], SamplingParams(n=3, temperature=1.0))
    engine.check_idle()


def test_add_request_waits_for_a_step_in_progress() -> None:
    engine = _engine(overlap=False)  # an overlapped step() returns while its round runs
    inner_execute = engine.runner.execute
    in_step, release = threading.Event(), threading.Event()

    def execute(step: PreparedStep) -> object:
        in_step.set()
        release.wait()
        return inner_execute(step)

    engine.runner.execute = execute  # type: ignore[method-assign,assignment]
    engine.add_request("first", [1, 2, 3], GREEDY)
    outs: list[object] = []
    stepper = threading.Thread(target=lambda: outs.extend(engine.step()))
    stepper.start()
    assert in_step.wait(10)
    adder = threading.Thread(target=lambda: engine.add_request("second", [4, 5], GREEDY))
    adder.start()
    adder.join(0.3)
    assert adder.is_alive(), "add_request ran while step() was inside the round"
    release.set()
    stepper.join(10)
    adder.join(10)
    assert not adder.is_alive()
    done = {o.request_id for o in engine.run()}
    assert done == {"first", "second"}
    engine.check_idle()


def _fault_run(num: int, seed: int, faults: bool) -> tuple[dict[str, object], set[str], Engine]:
    rng = random.Random(seed)
    engine = _engine(num_blocks=40, block_size=8, max_model_len=160, max_num_seqs=16,
                     max_num_batched_tokens=128)
    injector = (
        FaultInjector(engine, seed, p_forward=0.03, p_sampler=0.03, p_commit=0.03, p_nan=0.05)
        if faults else None
    )
    aborted: set[str] = set()
    pending = []
    for i in range(num):
        n = 2 if i % 11 == 0 else 1
        params = SamplingParams(n=n, temperature=0.8 if n > 1 else 0.0, seed=i,
                                max_tokens=rng.randint(1, 16), ignore_eos=True)
        prompt = [rng.randrange(1, 250) for _ in range(rng.randint(1, 40))]
        if i % 4 == 0:
            prompt = [9] * 16 + prompt[:8]
        pending.append((f"r{i}", prompt, params, rng.random() < 0.1))
    outs: dict[str, object] = {}
    steps = 0
    bad_inputs = [([], GREEDY), ([10**6], GREEDY), ([1] * 200, GREEDY), ([1], "params")]
    while pending or engine.has_unfinished_requests():
        for rid, prompt, params, abort in pending[:8]:
            engine.add_request(rid, prompt, params)
            if abort:
                aborted.add(rid)
        del pending[:8]
        if faults and steps % 5 == 0:
            prompt, params = bad_inputs[steps // 5 % len(bad_inputs)]
            with pytest.raises(ConfigError):
                engine.add_request(f"bad{steps}", prompt, params)  # type: ignore[arg-type]
        for out in engine.step():
            assert out.request_id not in outs, f"{out.request_id} reported twice"
            outs[out.request_id] = out
        steps += 1
        if steps % 3 == 0:
            for rid in sorted(aborted)[:3]:
                engine.abort(rid)
        assert steps < 20_000, "the engine must not hang"
    outs.update({o.request_id: o for o in engine.flush()})
    engine.check_idle()
    hurt = aborted | (injector.poisoned if injector else set())
    return outs, hurt, engine


def _check_fault_run(num: int, seed: int) -> None:
    clean, _, _ = _fault_run(num, seed, faults=False)
    faulty, hurt, _ = _fault_run(num, seed, faults=True)
    assert set(faulty) == {f"r{i}" for i in range(num)}, "every request ends with an output"
    reasons = {c.finish_reason for o in faulty.values() for c in o.outputs}  # type: ignore[attr-defined]
    assert reasons <= {"length", "abort", "error"} and "error" in reasons, reasons
    same = 0
    for rid, out in faulty.items():
        for comp, want in zip(out.outputs, clean[rid].outputs):  # type: ignore[attr-defined]
            assert comp.finish_reason is not None
            if comp.finish_reason == "length" and rid not in hurt:
                assert comp.token_ids == want.token_ids, rid
                same += 1
            if comp.finish_reason == "error":
                assert comp.stop_reason, rid
    assert same > num // 3


def test_fault_run_quick() -> None:
    _check_fault_run(120, seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_fault_run_500_requests(seed: int) -> None:
    _check_fault_run(500, seed=seed)


def test_kv_storage_and_cache_manager_must_agree_at_start() -> None:
    from deepinfer_kit.cache.manager import BlockKVCacheManager
    from deepinfer_kit.cache.records import CacheConfig
    from deepinfer_kit.sched import ContinuousBatchScheduler, SchedulerConfig

    built = _engine(num_blocks=32, block_size=8)
    for block_size, num_blocks in ((16, 32), (8, 31)):
        cache = BlockKVCacheManager.create(CacheConfig(block_size=block_size, num_blocks=num_blocks))
        with pytest.raises(ConfigError, match="KV storage has 32 blocks of 8 tokens but the cache manager"):
            Engine(runner=built.runner, scheduler=ContinuousBatchScheduler(SchedulerConfig(), cache),
                   cache=cache, tokenizer=None, vocab_size=built.vocab_size, eos_token_id=None)
