"""Every component kind reaches the engine through ``Components`` (public parameters only:
no attribute writes, no worker_setup) and is the one the engine uses: each test injects a
small component of its own (tests/own_components.py) and shows its effect in what the
engine reports — traces, tokens, plans, prefix hits, placements — in process, and for the
device kinds in a worker process too."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import own_components as own
from deepinfer_kit import (
    BuildContext, Components, ConfigError, EngineDeadError, Factory, SamplingParams, build_engine,
)
from deepinfer_kit.engine.engine import Engine
from deepinfer_kit.engine.trace import StepTrace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SMALL = {"num_blocks": 64, "block_size": 4, "max_model_len": 128}


def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    outs = {o.request_id: list(o.outputs[0].token_ids) for o in engine.run()}
    engine.check_idle()
    return outs


def _prompts(n: int = 4, length: int = 12, shared: int = 0) -> list[list[int]]:
    head = [7, 8, 9, 10] * (shared // 4)
    return [head + [(11 * i + j) % 200 + 3 for j in range(length)] for i in range(n)]


# ---- host kinds ----------------------------------------------------------------------------


def test_block_allocator_is_the_engines_pool() -> None:
    engine = build_engine(components=Components(block_allocator=Factory(own.make_allocator)), **SMALL)
    pool = engine.cache.allocator  # type: ignore[attr-defined]
    assert isinstance(pool, own.CountingAllocator)
    _run(engine, _prompts())
    assert pool.calls > 0
    with pytest.raises(ConfigError, match="block_allocator holds 10 blocks"):
        build_engine(components=Components(block_allocator=own.CountingAllocator(10, 4)), **SMALL)


def test_an_injected_eviction_policy_evicts_and_the_trace_reports_it() -> None:
    policy = own.MRUEvictionPolicy()
    traces: list[StepTrace] = []
    engine = build_engine(components=Components(eviction_policy=policy), trace=traces.append,
                          num_blocks=24, block_size=4, max_model_len=64, max_num_seqs=2)
    _run(engine, _prompts(n=10, length=20))
    evicted = sum(t.blocks_evicted for t in traces)
    assert evicted > 0 and evicted == len(policy.evicted)
    assert engine.cache.index._policy is policy  # type: ignore[attr-defined]


def test_an_injected_prefix_index_serves_the_hits() -> None:
    traces: list[StepTrace] = []
    engine = build_engine(components=Components(prefix_index=Factory(own.make_index)), trace=traces.append,
                          **SMALL)
    index = engine.cache.index  # type: ignore[attr-defined]
    assert isinstance(index, own.CountingIndex)
    for i in range(3):  # one after another: the later ones hit the first's blocks
        _run(engine, [_prompts(n=1, length=4, shared=16)[0] + [i + 3]])
    assert index.lookups > 0 and sum(t.prefix_hit_tokens for t in traces) >= 32


def test_an_injected_cache_manager_is_what_reset_and_the_idle_check_read() -> None:
    engine = build_engine(components=Components(cache_manager=Factory(own.make_cache)), **SMALL)
    cache = engine.cache
    assert isinstance(cache, own.CountingCache) and engine.scheduler.cache is cache  # type: ignore[attr-defined]
    _run(engine, _prompts(shared=8))
    assert engine.reset_prefix_cache() and cache.resets == 1
    with pytest.raises(ConfigError, match="cache_manager owns its block_allocator"):
        Components(cache_manager=Factory(own.make_cache), block_allocator=Factory(own.make_allocator))


def test_an_admission_policy_orders_the_queue() -> None:
    traces: list[StepTrace] = []
    engine = build_engine(components=Components(admission_policy=own.shortest_prompt_first),
                          trace=traces.append, max_num_seqs=1, **SMALL)
    prompts = [[5] * 30, [6] * 3, [7] * 12]
    _run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=1))
    first = [t.chunks[0].request_id for t in traces if t.chunks]
    assert first == ["r1", "r2", "r0"]  # shortest prompt first, not arrival order


def test_a_preemption_policy_chooses_the_victims() -> None:
    victim = own.NewestVictim()
    traces: list[StepTrace] = []
    engine = build_engine(components=Components(preemption_policy=victim), trace=traces.append,
                          num_blocks=12, block_size=4, max_model_len=48, max_num_seqs=4)
    _run(engine, _prompts(n=4, length=10), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    preempted = [rid for t in traces for rid in t.preempted]
    assert preempted and preempted == victim.victims


def test_a_batching_policy_decides_what_never_fits() -> None:
    engine = build_engine(components=Components(batching_policy=own.ShortPromptsOnly(limit=20)), **SMALL)
    with pytest.raises(ConfigError, match="ShortPromptsOnly refuses prompts over 20 tokens"):
        engine.add_request("long", [3] * 30, GREEDY)
    assert _run(engine, [[3] * 10])["r0"]


def test_a_scheduler_factory_gets_the_engines_cache_and_clock() -> None:
    traces: list[StepTrace] = []
    engine = build_engine(components=Components(scheduler=Factory(own.CountingScheduler)),
                          trace=traces.append, **SMALL)
    sched = engine.scheduler
    assert isinstance(sched, own.CountingScheduler) and sched.cache is engine.cache
    _run(engine, _prompts())
    assert sched.rounds >= len(traces) > 0

    def own_cache(ctx: BuildContext) -> Any:
        return own.CountingScheduler(attrs_evolve(ctx, cache=own.make_cache(ctx)))

    with pytest.raises(ConfigError, match="KV cache manager of its own"):
        build_engine(components=Components(scheduler=Factory(own_cache)), **SMALL)


def attrs_evolve(ctx: BuildContext, **changes: Any) -> BuildContext:
    import attrs

    return attrs.evolve(ctx, **changes)


def test_an_executor_runs_the_steps() -> None:
    executor = own.CountingExecutor()
    engine = build_engine(components=Components(executor=executor), **SMALL)
    assert engine.executor is executor
    _run(engine, _prompts())
    assert executor.launches > 0


# ---- device kinds, in process and in a worker process -----------------------------------

WORKERS = [pytest.param("inline", id="inline"), pytest.param("process", id="worker")]


def _device_engine(worker: str, parts: Components, **config: Any) -> tuple[Engine, list[StepTrace]]:
    traces: list[StepTrace] = []
    engine = build_engine(components=parts, trace=traces.append, worker=worker,
                          **({"overlap": False} if worker == "process" else {}), **config)
    return engine, traces


def _served(worker: str, parts: Components, prompts: list[list[int]], **config: Any) -> tuple[dict[str, list[int]], list[StepTrace]]:
    engine, traces = _device_engine(worker, parts, **{**SMALL, **config})
    try:
        return _run(engine, prompts), traces
    finally:
        engine.close()


@pytest.fixture(scope="module")
def plain() -> dict[str, list[int]]:
    engine = build_engine(**SMALL)
    return _run(engine, _prompts())


@pytest.mark.parametrize("worker", WORKERS)
def test_a_sampler_draws_the_tokens(worker: str, plain: dict[str, list[int]]) -> None:
    got, _ = _served(worker, Components(sampler=Factory(own.make_sampler)), _prompts())
    assert got != plain  # second-best, not greedy
    again, _ = _served("inline", Components(sampler=own.SecondBestSampler()), _prompts())
    assert again == got  # an instance in process, a factory in the worker: the same component


@pytest.mark.parametrize("worker", WORKERS)
def test_a_drafter_proposes_and_output_stays_exact(worker: str, plain: dict[str, list[int]]) -> None:
    parts = Components(drafter=Factory(own.make_drafter))
    got, traces = _served(worker, parts, _prompts(), speculative={"num_draft": 3})
    assert got == plain
    assert sum(t.num_drafted for t in traces) > 0


@pytest.mark.parametrize("worker", WORKERS)
def test_a_verify_planner_cuts_the_drafts(worker: str, plain: dict[str, list[int]]) -> None:
    parts = Components(drafter=Factory(own.make_drafter), verify_planner=Factory(own.make_planner))
    got, traces = _served(worker, parts, _prompts(), speculative={"num_draft": 4})
    assert got == plain
    drafted = [t.num_drafted for t in traces]
    assert sum(drafted) > 0
    assert all(t.num_drafted <= len(t.chunks) for t in traces)  # at most one per chunk


@pytest.mark.parametrize("worker", WORKERS)
def test_a_draft_verifier_decides_what_is_accepted(worker: str, plain: dict[str, list[int]]) -> None:
    parts = Components(drafter=Factory(own.make_drafter), draft_verifier=Factory(own.make_verifier))
    got, traces = _served(worker, parts, _prompts(), speculative={"num_draft": 3})
    drafted, accepted = sum(t.num_drafted for t in traces), sum(t.num_accepted for t in traces)
    assert drafted > 0 and accepted == drafted  # every draft kept: not what the built-in keeps
    assert got != plain and any(out[i] == out[i + 1] for out in got.values() for i in range(len(out) - 1))


@pytest.mark.parametrize("worker", WORKERS)
def test_a_router_routes_every_layer(worker: str) -> None:
    got, traces = _served(worker, Components(router=Factory(own.make_router)), _prompts())
    counts = [layer for t in traces if t.expert_counts for layer in t.expert_counts]
    assert counts and got
    for layer in counts:
        assert sum(layer) > 0 and all(c == 0 for c in layer[2:])  # tiny model: top-2 -> experts 0, 1


@pytest.mark.parametrize("worker", WORKERS)
def test_a_dispatcher_carries_the_expert_outputs(worker: str, plain: dict[str, list[int]]) -> None:
    got, _ = _served(worker, Components(dispatcher=Factory(own.make_dispatcher)), _prompts())
    assert got != plain  # the muted dispatcher drops the routed experts' output
    if worker == "process":
        inline, _ = _served("inline", Components(dispatcher=Factory(own.make_dispatcher)), _prompts())
        assert got == inline


EPLB = {"window": 3, "interval": 2, "num_redundant": 4, "num_gpus": 2}


@pytest.mark.parametrize("worker", WORKERS)
def test_a_replica_selector_picks_the_replicas(worker: str) -> None:
    parts = Components(replica_selector=Factory(own.make_selector))
    got, traces = _served(worker, parts, _prompts(), eplb=EPLB)
    slots = [layer for t in traces if t.slot_counts for layer in t.slot_counts]
    assert slots and got
    experts = len(slots[0]) - EPLB["num_redundant"]
    for layer in slots:  # E experts over E + 4 slots: only each expert's first replica serves
        assert sum(1 for c in layer if c) <= experts < len(layer)


@pytest.mark.parametrize("worker", WORKERS)
def test_a_placement_policy_places_the_experts(worker: str) -> None:
    parts = Components(placement_policy=Factory(own.make_policy))
    engine, _ = _device_engine(worker, parts, eplb=EPLB, **SMALL)
    try:
        _run(engine, _prompts(n=6), SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
        history = engine.balancer.history  # type: ignore[union-attr]
        assert len(history) >= 2
        first = history[0].phy2log
        assert all(torch.equal(r.phy2log, first) for r in history)  # frozen: never moves
        if worker == "inline":
            assert engine.balancer.policy.calls == len(history)  # type: ignore[union-attr]
    finally:
        engine.close()


# ---- refusals, and the fail-fast mode ------------------------------------------------------


def _local_factory(ctx: BuildContext) -> Any:
    return own.SecondBestSampler()


class _Unpicklable(own.SecondBestSampler):
    def __reduce__(self) -> Any:
        raise TypeError("not picklable")


def test_components_that_cannot_work_are_refused_at_build() -> None:
    with pytest.raises(ConfigError, match="does not pickle.*Factory"):
        build_engine(worker="process", components=Components(sampler=_Unpicklable()), **SMALL)
    with pytest.raises(ConfigError, match="module-level callable"):
        build_engine(worker="process", components=Components(sampler=Factory(lambda ctx: None)), **SMALL)
    with pytest.raises(ConfigError, match="router is built once per MoE layer"):
        Components(router=own.FirstExpertsRouter(None))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="drafter needs speculative"):
        build_engine(components=Components(drafter=own.RepeatLastDrafter()), **SMALL)
    with pytest.raises(ConfigError, match="placement_policy needs eplb"):
        build_engine(components=Components(placement_policy=own.FrozenPlacementPolicy()), **SMALL)
    with pytest.raises(ConfigError, match="prefix_index.*enable_prefix_caching=False"):
        build_engine(components=Components(prefix_index=Factory(own.make_index)),
                     enable_prefix_caching=False, **SMALL)
    assert _local_factory  # a local function is fine in process (not crossing)
    build_engine(components=Components(sampler=Factory(_local_factory)), **SMALL).close()


class _Boom(RuntimeError):
    pass


class _RaisingSampler(own.SecondBestSampler):
    def __call__(self, logits: torch.Tensor, batch: Any) -> Any:
        raise _Boom("the component under development raised")


def test_strict_components_stop_at_the_first_failure_with_its_traceback() -> None:
    lenient = build_engine(components=Components(sampler=_RaisingSampler()), **SMALL)
    outs = _run(lenient, _prompts(n=1))
    assert outs == {"r0": []}  # ended with error, the engine goes on
    strict = build_engine(components=Components(sampler=_RaisingSampler()), strict_components=True, **SMALL)
    strict.add_request("a", [3, 4, 5], GREEDY)
    with pytest.raises(_Boom, match="under development"):
        strict.step()
    with pytest.raises(EngineDeadError, match="strict_components"):
        strict.step()
