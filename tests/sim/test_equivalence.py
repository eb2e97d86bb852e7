"""The simulated engine and the real engine (embedded tiny model, forward and sampler
run, sampled tokens replaced by the synthetic source) make identical decisions on the
same trace: plans (chunks, block tables, copies), preemptions, prefix hits, finish order."""

from __future__ import annotations

import heapq
from typing import Any

import pytest

from deepinfer_kit import SamplingParams, build_engine
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.engine.trace import StepTrace
from deepinfer_kit.sched.records import SchedulePlan
from deepinfer_kit.sim import (
    LengthDist, ModelShape, ProfiledCost, SimRequest, SyntheticTokens, WorkloadConfig,
    build_simulator, generate,
)
from deepinfer_kit.sim.prompts import PromptBuilder
from deepinfer_kit.step import StepResult

TINY = ModelShape(hidden_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=128, vocab_size=259, dtype_bytes=4,
                  max_position_embeddings=4096)
UNIT_STEP = ProfiledCost(1.0, 0.0, 0.0, 0.0, "one virtual second per round")


def snapshot(plan: SchedulePlan) -> tuple[Any, ...]:
    return (
        plan.step_id,
        tuple((c.request_id, c.start, c.num_tokens, c.sample, c.num_cached_tokens,
               tuple(c.block_table), c.output_position) for c in plan.all_chunks()),
        tuple(plan.block_copies), tuple(plan.preempted_ids), tuple(plan.finished_ids),
        plan.num_batched_tokens, plan.num_cached_tokens,
    )


class ForcedTokens:
    """The real ModelRunner, its sampled tokens replaced by the synthetic source."""

    def __init__(self, runner: Any, tokens: SyntheticTokens) -> None:
        self.runner = runner
        self.tokens = tokens
        self.kv_cache = runner.kv_cache
        self.plans: list[tuple[Any, ...]] = []

    def prepare(self, plan: SchedulePlan, *, record_expert_counts: bool = False) -> Any:
        self.plans.append(snapshot(plan))
        return self.runner.prepare(plan, record_expert_counts=record_expert_counts)

    def check_idle(self) -> None:
        self.runner.check_idle()

    def execute(self, step: Any) -> StepResult:
        result: StepResult = self.runner.execute(step)
        assert not result.errors
        result.token_ids = [
            [self.tokens.token(c.request_id, c.output_position)] if toks else []
            for c, toks in zip(step.plan.all_chunks(), result.token_ids)
        ]
        return result


def run_real(config: EngineConfig, requests: list[SimRequest]) -> tuple[list[Any], list[Any]]:
    """The simulator's loop (arrivals by a clock of one second per round) on the engine."""
    engine = build_engine(config)
    tokens = SyntheticTokens(engine.vocab_size, engine.eos_token_id, seed=0)
    prompts = PromptBuilder(engine.vocab_size, seed=0)
    forced = ForcedTokens(engine.runner, tokens)
    engine.runner = forced  # type: ignore[assignment]
    ran: list[int] = []

    def on_trace(t: StepTrace) -> None:
        ran.append(len(t.chunks))

    engine.subscribe(on_trace)
    roots = sorted((r for r in requests if r.after is None), key=lambda r: r.arrival_time)
    followers: dict[str, list[SimRequest]] = {}
    for r in requests:
        if r.after is not None:
            followers.setdefault(r.after, []).append(r)
    pending: list[tuple[float, int, SimRequest, list[int]]] = []
    clock, seq, i = 0.0, 0, 0
    finished: list[Any] = []
    while True:
        while True:
            rt = roots[i].arrival_time if i < len(roots) else float("inf")
            ft = pending[0][0] if pending else float("inf")
            if rt <= ft and rt <= clock:
                req, history = roots[i], []
                i += 1
            elif ft < rt and ft <= clock:
                _, _, req, history = heapq.heappop(pending)
            else:
                break
            tokens.register(req.request_id, req.output_len, req.stop_by_eos)
            engine.add_request(req.request_id, prompts.build(req, history),
                               SamplingParams(max_tokens=req.output_len), priority=req.priority)
        if not engine.has_unfinished_requests():
            if rt == float("inf") and ft == float("inf"):
                break
            clock = max(clock, min(rt, ft))
            continue
        outs = engine.step()
        clock += 1.0 if ran[-1] else 0.0
        for out in outs:
            comp = out.outputs[0]
            finished.append((out.request_id, comp.finish_reason, tuple(comp.token_ids)))
            for nxt in followers.pop(out.request_id, ()):
                heapq.heappush(pending, (clock + nxt.think_time, seq, nxt,
                                         out.prompt_token_ids + comp.token_ids))
                seq += 1
    engine.check_idle()
    return forced.plans, finished


def run_sim(config: EngineConfig, requests: list[SimRequest]) -> tuple[list[Any], list[Any]]:
    sim = build_simulator(config, UNIT_STEP, TINY, eos_token_id=257)
    plans: list[Any] = []
    sim.runner.tokens.forget("")  # the registry starts empty
    finished: list[Any] = []
    original = sim.scheduler.commit

    def observe(plan: SchedulePlan, result: StepResult, start: float, end: float) -> None:
        if plan.all_chunks():
            plans.append(snapshot(plan))

    def commit(plan: SchedulePlan, result: StepResult) -> Any:
        outs = original(plan, result)
        finished.extend((o.request_id, o.outputs[0].finish_reason,
                         tuple(o.outputs[0].token_ids)) for o in outs)
        return outs

    sim.scheduler.commit = commit  # type: ignore[method-assign]
    sim.run(requests, observer=observe)
    sim.cache.check_integrity(())
    return plans, finished


CASES = {
    "fcfs-preempting": dict(block_size=4, num_blocks=48, max_num_batched_tokens=48,
                            max_num_seqs=8),
    "priority-hash": dict(block_size=8, num_blocks=24, max_num_batched_tokens=64,
                          max_num_seqs=6, scheduler_policy="priority", prefix_index="hash",
                          long_prefill_token_threshold=16),
    "roomy": dict(block_size=16, num_blocks=64, max_num_batched_tokens=128, max_num_seqs=16),
}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", sorted(CASES))
def test_sim_and_real_engine_decide_identically(case: str, seed: int) -> None:
    # overlap=False: the simulator decides step by step, as the synchronous engine does
    config = EngineConfig(max_model_len=192, overlap=False, **CASES[case])  # type: ignore[arg-type]
    workload = generate(WorkloadConfig(
        num_requests=36, seed=seed, rate=1.5,
        prompt_len=LengthDist("uniform", 24, 0.9, 2, 48),
        output_len=LengthDist("uniform", 12, 0.9, 1, 24),
        shared_fraction=0.5, shared_prefix_len=20, num_shared_prefixes=2, eos_fraction=0.5,
        multi_turn_fraction=0.4, turns=3, followup_len=LengthDist("uniform", 6, 0.8, 1, 12),
        think_time=2.0, priority_levels=3 if "priority" in case else 1,
    ))
    real_plans, real_done = run_real(config, workload)
    sim_plans, sim_done = run_sim(config, workload)
    assert len(real_done) == len(workload)
    for k, (a, b) in enumerate(zip(real_plans, sim_plans)):
        assert a == b, f"round {k} differs:\nreal {a}\nsim  {b}"
    assert len(real_plans) == len(sim_plans)
    assert real_done == sim_done
    # The trace exercised what it claims to compare.
    assert sum(p[6] for p in sim_plans) > 0, "no prefix hits"
    if case == "fcfs-preempting":
        assert any(p[3] for p in sim_plans), "no preemption"
