"""Tensor parallelism in the engine: T worker processes (gloo), each holding its shard;
outputs equal the single-process engine's for every kind of model family, alone and inside
expert-parallel groups."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from deepinfer_kit import ConfigError, EngineConfig, SamplingParams, build_engine
from deepinfer_kit.engine.runner.balance import moe_layers
from deepinfer_kit.engine.runner.model_runner import ModelRunner
from deepinfer_kit.moe.ep_dispatcher import ExpertParallelDispatcher
from differential import run_workload, workload

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

from hf_models import make_checkpoint  # noqa: E402

POOL = {"num_blocks": 48, "block_size": 8, "max_model_len": 96, "max_num_seqs": 6,
        "max_num_batched_tokens": 48, "long_prefill_token_threshold": 16}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp_engine")
    made = {}
    for family in ("llama-llama3", "qwen2_moe", "llama", "glm4_moe"):
        make_checkpoint(family, root / family, seed=2)
        made[family] = str(root / family)
    return made


class ChecksShards:
    """worker_setup: fail the rank's build unless its model is a T-way shard (attention
    heads and vocabulary rows) whose MoE layers hold E / expert_parallel experts."""

    def __init__(self, tp: int, ep: int) -> None:
        self.tp, self.ep = tp, ep

    def __call__(self, runner: ModelRunner) -> None:
        model: Any = runner.model
        assert model.tp is not None and model.tp.world_size == self.tp
        attn = model.decoder_layers[0].self_attn
        assert attn.num_heads == model.config.num_heads // self.tp
        assert model.embed_tokens.shape[0] == -(-model.config.vocab_size // self.tp)
        for layer in moe_layers(model):
            held = layer.experts.gate_up.shape[0]
            if self.ep > 1:
                assert isinstance(layer.dispatcher, ExpertParallelDispatcher)
                assert layer.dispatcher.world_size == self.ep
            assert held == layer.config.num_experts // self.ep, held


def _small_vocab(reqs: Any) -> Any:
    """The workload's prompts folded into the tiny checkpoints' 160 ids."""
    return [(rid, [t % 160 for t in prompt], params) for rid, prompt, params in reqs]


def _same(model: str, overlap: bool, reqs: Any, **parallel: Any) -> None:
    reqs = reqs if model == "tiny" else _small_vocab(reqs)
    want, _ = run_workload(reqs, False, model=model, **POOL)
    T, E = parallel.get("tensor_parallel", 1), parallel.get("expert_parallel", 1)
    got, engine = run_workload(reqs, overlap, model=model, worker="process", **parallel, **POOL,
                               worker_setup=ChecksShards(T, E))
    try:
        assert got == want
        assert len(engine.runner.pids) == T * E  # type: ignore[attr-defined]
    finally:
        engine.close()


def test_two_ranks_equal_the_single_process_engine_on_the_tiny_model() -> None:
    """The differential workload (greedy and seeded sampling, forks, penalties, logprobs,
    stops, prefix hits, chunked prefill) on the embedded MoE model, overlapped; every
    traced step carries both ranks' stats: 4 collectives per forward (the embedding, one
    o_proj per layer, the logits), the same resident bytes on each rank."""
    from deepinfer_kit import build_engine
    from deepinfer_kit.engine.trace import StepTrace

    reqs = workload(41, 12)
    want, local = run_workload(reqs, False, **POOL)
    whole = sum(p.numel() * p.element_size() for p in local.runner.model.parameters())  # type: ignore[attr-defined]
    traces: list[StepTrace] = []
    engine = build_engine(overlap=True, worker="process", tensor_parallel=2,
                          worker_setup=ChecksShards(2, 1), trace=traces.append, **POOL)
    try:
        got, _ = run_workload(reqs, engine=engine)
        assert got == want
        ran = [t for t in traces if t.chunks]  # a round with nothing scheduled runs no rank
        assert ran and all([r.rank for r in t.ranks] == [0, 1] for t in ran)
        for t in ran:
            for r in t.ranks:
                assert r.comm_calls == 4 and r.comm_s <= r.run_s and r.kv_bytes == t.ranks[0].kv_bytes
                assert whole / 2 < r.weight_bytes < whole
        assert "rank 1: run" in ran[-1].describe()
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["llama-llama3", "qwen2_moe"])
def test_two_ranks_equal_the_single_process_engine(family: str, folders: dict[str, str]) -> None:
    """One KV head (replicated on both ranks) with tied embeddings; MoE with a shared expert."""
    _same(folders[family], False, workload(43, 8), tensor_parallel=2)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["tiny", "llama", "llama-llama3", "qwen2_moe", "glm4_moe"])
def test_four_ranks_equal_the_single_process_engine(family: str, folders: dict[str, str]) -> None:
    _same(folders.get(family, family), False, workload(47, 8), tensor_parallel=4)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["tiny", "qwen2_moe"])
def test_tensor_parallel_inside_expert_parallel_groups(family: str, folders: dict[str, str]) -> None:
    """T = 2 inside E = 2: four ranks, attention sharded in pairs, experts split over them."""
    _same(folders.get(family, family), False, workload(53, 8), tensor_parallel=2, expert_parallel=2)


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "ep"), [(2, 1), (2, 2)], ids=["T2", "T2xE2"])
def test_eplb_rebalances_under_tensor_parallelism(tp: int, ep: int) -> None:
    """Live EPLB with the ranks tensor-parallel: the tokens are the single-process engine's
    and every rebalance places the slots as the in-process EPLB engine does (the experts
    replicated inside each tensor-parallel group, moved within each expert-parallel one)."""
    import torch

    eplb = {"window": 3, "interval": 2, "num_redundant": 2, "num_gpus": 2, "policy": "refine"}
    greedy = [(rid, p, params) for rid, p, params in workload(31, 10) if params.temperature == 0.0]
    reqs = greedy + [(f"g{i}", list(range(7 * i, 7 * i + 20)), greedy[0][2]) for i in range(4)]
    want, local = run_workload(reqs, False, eplb=eplb, **POOL)
    got, engine = run_workload(reqs, False, worker="process", tensor_parallel=tp, expert_parallel=ep,
                               eplb=eplb, **POOL)
    try:
        assert got == want
        here, there = local.balancer, engine.balancer
        assert here is not None and there is not None and len(here.history) >= 3
        assert sum(r.moved_slots for r in there.history) > 0
        assert [r.after_step for r in there.history] == [r.after_step for r in here.history]
        assert all(torch.equal(a.phy2log, b.phy2log) for a, b in zip(here.history, there.history))
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("spec", [{"drafter": "ngram", "num_draft": 3},
                                  {"drafter": "draft_model", "draft_model": "tiny", "num_draft": 2},
                                  {"drafter": "self", "draft_layers": 1, "num_draft": 2}],
                         ids=["ngram", "draft_model", "self"])
def test_speculative_decoding_over_two_ranks(spec: dict[str, Any]) -> None:
    """The worker ranks draft (each its own drafter, alike) and verify on the sharded target."""
    reqs = workload(61, 8)
    want, _ = run_workload(reqs, False, speculative=spec, **POOL)
    got, engine = run_workload(reqs, False, speculative=spec, worker="process", tensor_parallel=2, **POOL)
    engine.close()
    assert got == want


@pytest.mark.parametrize(("fields", "match"), [
    ({"tensor_parallel": 2}, "set worker='process'"),
    ({"collective_timeout": 0}, "collective_timeout"),
    ({"tensor_parallel": 0}, "tensor_parallel"),
])
def test_bad_parallel_settings_are_config_errors(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**fields)


@pytest.mark.slow
def test_dspark_drafting_over_two_ranks() -> None:
    """The DSpark backbone is the sharded target's first layers: its KV pool holds the rank's
    KV heads, and the greedy tokens are the single-process engine's."""
    spec = {"drafter": "dspark", "dspark_heads": "tiny-words", "num_draft": 3}
    prompts = [list(f"{i} the cat sat".encode()) for i in range(6)]
    outs = []
    for extra in ({}, {"worker": "process", "tensor_parallel": 2}):
        engine = build_engine(model="tiny-words", speculative=spec, num_blocks=128, max_model_len=128,
                              **extra)
        try:
            for i, p in enumerate(prompts):
                engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=16,
                                                              ignore_eos=True))
            outs.append({o.request_id: o.outputs[0].token_ids for o in engine.run()})
            engine.check_idle()
        finally:
            engine.close()
    assert outs[0] == outs[1]
