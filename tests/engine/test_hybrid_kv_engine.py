"""The hybrid KV cache through the whole engine: a 5 local : 1 global model (Qwen2 with
``layer_types``, window 5) keeps only each sequence's window in its sliding layers, in a
pool of their own, and its tokens stay transformers' greedy tokens — for prompts and decodes
far past the window, chunked prefill, prefix hits whose windows are cached, speculative
rounds rolled back, overlapped rounds — and equal the engine's with the cache off."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer_kit import SamplingParams, build_engine
from deepinfer_kit.cache.hybrid_kv import HybridKVCache
from deepinfer_kit.cache.hybrid_manager import HybridKVCacheManager

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

from hf_models import five_to_one, hf_greedy_full, hf_logits, serve_in_turn  # noqa: E402

NEW_TOKENS = 12
WINDOW = 5


def _five_to_one(factory: pytest.TempPathFactory, window: int, seed: int) -> tuple[Path, Any]:
    """A Qwen2 with 5 sliding layers (``window``) then 1 full one, saved; (folder, model)."""
    folder = factory.mktemp(f"qwen2_5to1_w{window}")
    return folder, five_to_one(folder, window, seed)


@pytest.fixture(scope="module")
def local_global(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    return _five_to_one(tmp_path_factory, WINDOW, 3)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(160) for _ in range(23)]
    return [shared + [rng.randrange(160) for _ in range(n)] for n in (3, 14)] + [[rng.randrange(160)] * 2]


def _run(folder: Path, prompts: list[list[int]], params: SamplingParams, **config: Any) -> list[list[int]]:
    engine = build_engine(model=str(folder), block_size=4, attention_impl="ref", **config)
    ids = [engine.add_request(None, p, params) for p in prompts]
    outs = {o.request_id: o for o in engine.run()}
    engine.check_idle()
    return [list(outs[i].outputs[0].token_ids) for i in ids]


def test_the_sliding_layers_get_a_pool_of_their_own(local_global: tuple[Path, Any]) -> None:
    folder, _ = local_global
    engine = build_engine(model=str(folder), block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    kv, cache = engine.runner.kv_cache, engine.cache
    assert isinstance(kv, HybridKVCache) and isinstance(cache, HybridKVCacheManager)
    assert kv.layout.group_of_layer == (1, 1, 1, 1, 1, 0)
    sliding = kv.pool(1)
    assert sliding is not None and sliding.num_layers == 5
    # every sequence's window (5 tokens + 1 of rollback room + 1 new: 3 blocks), a round's
    # new tokens (8 blocks), three times the windows again for idle windows
    assert sliding.num_blocks == 4 * 3 + 8 + 1 + 3 * 4 * 3
    assert build_engine(model=str(folder), hybrid_kv_cache=False).runner.kv_cache.num_layers == 6


@pytest.mark.parametrize("config", [
    pytest.param({}, id="plain"),
    pytest.param({"max_num_batched_tokens": 8}, id="chunked"),
    pytest.param({"speculative": {"drafter": "ngram", "num_draft": 3}}, id="speculative"),
    pytest.param({"overlap": True}, id="overlap"),
])
def test_greedy_tokens_equal_transformers(local_global: tuple[Path, Any], config: dict[str, Any]) -> None:
    folder, hf_model = local_global
    prompts = _prompts(4)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert _run(folder, prompts, params, **config) == [hf_greedy_full(hf_model, p, NEW_TOKENS) for p in prompts]


def test_prefix_hits_read_the_cached_windows(local_global: tuple[Path, Any]) -> None:
    """Later requests sharing a 23-token prefix hit it (the first request's windows stay
    idle in the sliding pool) and still decode transformers' tokens."""
    folder, hf_model = local_global
    prompts = _prompts(5)
    engine = build_engine(model=str(folder), block_size=4, attention_impl="ref")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first = engine.add_request(None, prompts[0], params)
    engine.run()
    later = [engine.add_request(None, p, params) for p in prompts[1:2]]
    outs = {o.request_id: o for o in engine.run()}
    engine.check_idle()
    assert outs[later[0]].num_cached_tokens >= 20, "the shared prefix was not hit"
    assert [list(outs[i].outputs[0].token_ids) for i in later] == [hf_greedy_full(hf_model, p, NEW_TOKENS) for p in prompts[1:2]]
    assert first


def test_seeded_sampling_equals_the_cache_off(local_global: tuple[Path, Any]) -> None:
    folder, _ = local_global
    prompts = _prompts(6)
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=NEW_TOKENS, ignore_eos=True)
    on = _run(folder, prompts, params, max_num_batched_tokens=8)
    assert on == _run(folder, prompts, params, max_num_batched_tokens=8, hybrid_kv_cache=False)


@pytest.mark.cuda
def test_cuda_graphs_and_triton_read_the_group_tables(local_global: tuple[Path, Any]) -> None:
    """On the GPU the captured decode gathers each group's tables inside the graph."""
    folder, hf_model = local_global
    prompts = _prompts(7)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine = build_engine(model=str(folder), device="cuda", dtype="float32", block_size=4, num_blocks=256)
    assert isinstance(engine.runner.kv_cache, HybridKVCache)
    ids = [engine.add_request(None, p, params) for p in prompts]
    outs = {o.request_id: o for o in engine.run()}
    engine.check_idle()
    assert [list(outs[i].outputs[0].token_ids) for i in ids] == [hf_greedy_full(hf_model, p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("config", [
    pytest.param({"worker": "process"}, id="worker-process"),
    pytest.param({"worker": "process", "tensor_parallel": 2}, id="tensor-parallel"),
])
def test_the_plan_carries_the_mappings_to_workers(local_global: tuple[Path, Any], config: dict[str, Any]) -> None:
    """A worker process (and each tensor-parallel rank) applies the plan's table updates to
    its own pools: the tokens are transformers'."""
    folder, hf_model = local_global
    prompts = _prompts(8)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert _run(folder, prompts, params, **config) == [hf_greedy_full(hf_model, p, NEW_TOKENS) for p in prompts]


def test_the_viewer_records_each_sequences_windows(local_global: tuple[Path, Any]) -> None:
    from deepinfer_kit.viewer.recorder import TraceRecorder
    from deepinfer_kit.viewer.schema import validate

    folder, _ = local_global
    engine = build_engine(model=str(folder), block_size=4, attention_impl="ref")
    recorder = TraceRecorder.attach(engine)
    for p in _prompts(9)[:2]:
        engine.add_request(None, p, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    engine.run()
    doc = recorder.document()
    validate(doc)
    last = [s["blocks"] for s in doc["steps"] if s["blocks"]["tables"]][-1]
    for rid, table in last["tables"].items():
        (window,) = last["windows"][rid]
        assert window == table[-len(window):] and len(window) < len(table)  # the tail only


@pytest.fixture(scope="module")
def narrow(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """The 5:1 layout with a 3-token window: a bounded replay needs 5 x 2 + 3 = 13 tokens."""
    return _five_to_one(tmp_path_factory, 3, 5)


@pytest.mark.parametrize("scheduler", ["continuous", "static"])
def test_a_bounded_replay_recomputes_the_windows_and_keeps_the_tokens(narrow: tuple[Path, Any],
                                                                      scheduler: str) -> None:
    """A 40-token prefix whose windows were evicted (other prompts filled the small sliding
    pool) but whose full-layer K/V is cached: the hit is kept whole and only the last
    blocks before it are recomputed, for the sliding layers alone; transformers' tokens."""
    folder, hf_model = narrow
    rng = random.Random(12)
    prefix = [rng.randrange(160) for _ in range(40)]
    engine = build_engine(model=str(folder), block_size=4, attention_impl="ref", max_num_seqs=2,
                          max_num_batched_tokens=64, scheduler=scheduler)
    assert isinstance(engine.cache, HybridKVCacheManager)
    assert engine.cache.layout.replay_bound == 13
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    prompts = [prefix + [1, 2, 3]]
    prompts += [[rng.randrange(160) for _ in range(60)] for _ in range(2)]  # evict the idle windows
    prompts += [prefix + [4, 5]]
    got, logprobs = serve_in_turn(engine, prompts, params)
    engine.check_idle()
    stats = engine.cache.window_stats
    assert stats.replays >= 1 and 0 < stats.replayed_tokens < 40
    assert got == [hf_greedy_full(hf_model, p, NEW_TOKENS) for p in prompts]
    for p, tokens, lps in zip(prompts, got, logprobs):  # the replayed windows are exact, not just close
        want = torch.log_softmax(hf_logits(hf_model, p + tokens[:-1])[len(p) - 1:], dim=-1)
        torch.testing.assert_close(torch.tensor(lps), want[torch.arange(len(tokens)), tokens], atol=2e-4, rtol=0)
