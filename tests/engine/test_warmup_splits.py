"""Warm-up covers every split count (split-K) the Triton paged attention can choose for the
engine's limits: the kernel launches are counted (under the interpreter, with the kernels
replaced by recorders and a GPU-sized program target), against a brute force of the
selector over every batch size and context length."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepinfer_kit import build_engine
from deepinfer_kit.engine.runner import warmup
from deepinfer_kit.models.attention import splits

pytestmark = pytest.mark.triton

LIMITS = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "max_model_len": 4096}
TARGET = 264  # the program target of a 132-SM GPU


class _Recorder:
    """Stands in for a Triton kernel: records ``NUM_SPLITS`` of each launch and zeroes the
    output (argument ``out_arg``) so the forward stays finite."""

    def __init__(self, out_arg: int, seen: set[int]) -> None:
        self.out_arg, self.seen = out_arg, seen

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **meta: Any) -> None:
            self.seen.add(meta["NUM_SPLITS"])
            args[self.out_arg].zero_()

        return launch


def _brute_force(max_requests: int, max_model_len: int, num_kv_heads: int) -> set[int]:
    return {splits.num_splits_for(1, r, s, num_kv_heads, TARGET)
            for r in range(1, max_requests + 1) for s in range(1, max_model_len + 1)}


def test_witnesses_match_a_brute_force_of_the_selector() -> None:
    for requests, length, heads, target in [(6, 4096, 2, TARGET), (3, 700, 8, 64),
                                            (64, 20000, 1, 2 * 132), (1, 1, 4, 1)]:
        witnesses = splits.num_splits_witnesses(requests, length, heads, target)
        assert {splits.num_splits_for(1, r, s, heads, target) for r in range(1, requests + 1)
                for s in range(1, length + 1, 7)} <= set(witnesses)
        for count, (r, s) in witnesses.items():
            assert r <= requests and s <= length
            assert splits.num_splits_for(1, r, s, heads, target) == count
    assert set(splits.num_splits_witnesses(6, 4096, 2, TARGET)) == _brute_force(6, 4096, 2)


def test_warm_up_launches_every_split_count(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepinfer_kit.models.attention import triton_ops

    engine = build_engine(attention_impl="triton", num_blocks=260, block_size=16, **LIMITS)
    heads = engine.runner.model.config.num_kv_heads
    want = _brute_force(min(LIMITS["max_num_seqs"], LIMITS["max_num_batched_tokens"]),
                        LIMITS["max_model_len"], heads)
    assert len(want) > 8  # the GPU-sized target makes long decodes split
    seen: set[int] = set()
    merged: set[int] = set()
    monkeypatch.setattr(triton_ops, "_paged_attn_kernel", _Recorder(3, seen))
    monkeypatch.setattr(triton_ops, "_merge_splits_kernel", _Recorder(2, merged))
    monkeypatch.setattr(splits, "split_target", lambda device: TARGET)
    monkeypatch.setattr(warmup, "split_target", lambda device: TARGET)
    cache = engine.runner.kv_cache
    before = cache.key_cache(0).clone()
    warmup.warm_up(engine.runner, max_num_seqs=LIMITS["max_num_seqs"],
                   max_num_batched_tokens=LIMITS["max_num_batched_tokens"],
                   max_model_len=LIMITS["max_model_len"], capture=False)
    assert seen == want
    assert merged == want - {1}
    assert torch.equal(cache.key_cache(0), before)


def test_split_rounds_warm_64_row_tiles_of_short_verify_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a GQA group of 4, a verify round of 5 to 8 tokens per request has more than 16
    query rows per KV head (64-row tiles) and may still split: warm-up runs such a round
    at every split count it can get, besides the decode rounds."""
    from types import SimpleNamespace

    from deepinfer_kit.models.attention.triton_ops import tile_config

    config = SimpleNamespace(num_heads=32, num_kv_heads=8)
    runner: Any = SimpleNamespace(model=SimpleNamespace(config=config), device=torch.device("cpu"))
    monkeypatch.setattr(warmup, "split_target", lambda device: TARGET)
    rounds = warmup.split_rounds(runner, max_num_seqs=16, max_num_batched_tokens=256,
                                 max_model_len=4096)

    def warmed(block_m: int) -> set[int]:
        return {splits.num_splits_for(max(q), len(q), max(s), 8, TARGET) for q, s in rounds
                if tile_config(max(q), 4, 128, True)[0] == block_m}

    for block_m, queries in ((16, range(1, 5)), (64, range(5, 9))):
        reachable = {splits.num_splits_for(q, r, s, 8, TARGET) for q in queries
                     for r in range(1, min(16, 256 // q) + 1) for s in range(q, 4097, 13)}
        assert reachable <= warmed(block_m), block_m
        assert len(reachable) > 1
