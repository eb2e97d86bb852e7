"""Expert parallelism in the engine: one worker process per rank, each holding E / W
experts per MoE layer, token copies exchanged by all-to-all (gloo); outputs equal the
single-process engine's."""

from __future__ import annotations


import pytest

from deepinfer_kit import ConfigError, EngineConfig, build_engine
from deepinfer_kit.engine.runner.balance import moe_layers
from deepinfer_kit.engine.runner.model_runner import ModelRunner
from deepinfer_kit.moe.ep_dispatcher import ExpertParallelDispatcher
from differential import run_workload, workload
from faults import RunnerFaults, fail_commits, run_to_end

POOL = {"num_blocks": 48, "block_size": 8, "max_model_len": 96, "max_num_seqs": 6,
        "max_num_batched_tokens": 48, "long_prefill_token_threshold": 16}


class ChecksShards:
    """worker_setup: fail the worker's build unless every MoE layer is this rank's shard."""

    def __init__(self, world: int) -> None:
        self.world = world

    def __call__(self, runner: ModelRunner) -> None:
        for layer in moe_layers(runner.model):
            dispatcher = layer.dispatcher
            assert isinstance(dispatcher, ExpertParallelDispatcher), type(dispatcher)
            assert dispatcher.world_size == self.world
            held = layer.experts.gate_up.shape[0]
            assert held == layer.config.num_experts // self.world, held
            first = dispatcher.rank * held
            assert dispatcher.local_experts == tuple(range(first, first + held))


FOUR_RANKS = pytest.param(4, False, id="4-sync", marks=pytest.mark.slow)  # 2 ranks cover it by default


@pytest.mark.parametrize(("world", "overlap"), [(2, False), (2, True), FOUR_RANKS],
                         ids=["2-sync", "2-overlap", "4-sync"])
def test_expert_parallel_ranks_equal_the_single_process_engine(world: int, overlap: bool) -> None:
    """The differential workload: greedy and seeded sampling, forks, penalties, logprobs,
    stops, prefix hits, chunked prefill and preemption."""
    reqs = workload(29, 14)
    want, _ = run_workload(reqs, False, **POOL)
    got, engine = run_workload(reqs, overlap, worker="process", expert_parallel=world,
                               worker_setup=ChecksShards(world), **POOL)
    try:
        assert got == want
        assert len(engine.runner.pids) == world  # type: ignore[attr-defined]
    finally:
        engine.close()


FOUR_RANKS_EPLB = pytest.param(4, False, "static", id="4-sync", marks=pytest.mark.slow)


@pytest.mark.parametrize(("world", "overlap", "dispatch"),
                         [(2, False, "static"), (2, True, "static"), (2, False, "balanced"), FOUR_RANKS_EPLB],
                         ids=["2-sync", "2-overlap", "2-sync-balanced", "4-sync"])
def test_eplb_moves_expert_weights_rank_to_rank(world: int, overlap: bool, dispatch: str) -> None:
    """Ranks with redundant slots (2 ranks of 5 slots, 4 of 3): every rank's window sees
    the same tokens, plans alike and exchanges slots by all-to-all between steps. The
    tokens are the single-process engine's; the plans are those of the in-process EPLB
    engine (same steps; the window is all-reduced over the ranks, each of which routes
    every token, so it is ``world`` times the single process's)."""
    import torch

    eplb = {"window": 3, "interval": 2, "num_redundant": world, "num_gpus": world, "policy": "refine",
            "dispatch": dispatch}
    greedy = [(rid, p, params) for rid, p, params in workload(31, 10) if params.temperature == 0.0]
    reqs = greedy + [(f"g{i}", list(range(7 * i, 7 * i + 20)), greedy[0][2]) for i in range(4)]
    want, local = run_workload(reqs, overlap, eplb=eplb, **POOL)
    got, engine = run_workload(reqs, overlap, worker="process", expert_parallel=world, eplb=eplb, **POOL)
    try:
        assert got == want
        here, there = local.balancer, engine.balancer
        assert here is not None and there is not None and len(here.history) >= 3
        assert sum(r.moved_slots for r in there.history) > 0
        assert [r.after_step for r in there.history] == [r.after_step for r in here.history]
        for a, b in zip(here.history, there.history):  # every rank records the whole load:
            assert torch.equal(a.window * world, b.window)  # each rank routes every token
            assert torch.equal(a.phy2log, b.phy2log)
    finally:
        engine.close()


def test_what_expert_parallelism_needs() -> None:
    with pytest.raises(ConfigError, match="set worker='process'"):
        EngineConfig(expert_parallel=2)
    with pytest.raises(ConfigError, match="eplb.num_gpus must be 2, got 4"):
        EngineConfig(expert_parallel=2, worker="process", eplb={"window": 2, "interval": 2, "num_gpus": 4})
    with pytest.raises(ConfigError, match="expert_parallel must be an int >= 1"):
        EngineConfig(expert_parallel=0)
    with pytest.raises(ConfigError, match="expert_parallel=3 must divide the 8 expert slots per layer"):
        build_engine(worker="process", expert_parallel=3, **POOL)


def test_faults_on_every_rank_lose_nothing() -> None:
    """The fault injector draws from one seed on every rank, so a forward or sampler that
    raises, or a NaN row, happens on all ranks at the same point (before any collective
    of that forward): the step fails alone, every request ends with a reason, and the
    ranks keep serving."""
    engine = build_engine(overlap=True, worker="process", expert_parallel=2,
                          worker_setup=RunnerFaults(6, p_forward=0.08, p_sampler=0.05, p_nan=0.08), **POOL)
    fail_commits(engine, 6, 0.05)
    try:
        outs, reasons = run_to_end(engine, workload(37, 16))
        assert "error" in reasons and {"stop", "length"} & set(reasons)
        messages = {str(c.stop_reason) for o in outs.values() for c in o.outputs if c.finish_reason == "error"}
        assert any("InjectedFault" in m for m in messages), messages
        assert not any("other tokens than rank 0" in m for m in messages), messages  # ranks agreed
        engine.check_idle()
    finally:
        engine.close()
