"""Captured decode graphs per context bucket: a short context does not pay the split count
of ``max_model_len``. The bucket rule, the graph a round replays, and the builder's wiring
(capture itself is a ``cuda`` test in test_cuda_graphs.py)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from deepinfer_kit import SamplingParams, build_engine
from deepinfer_kit.engine.runner.static_decode import StaticDecode, batch_ladder
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.attention.splits import decode_context_buckets, num_splits_for

H200 = 2 * 132  # split_target of an H200 (132 SMs)


def test_a_batch_of_one_gets_a_bound_per_split_count_and_a_full_batch_one_bound() -> None:
    buckets = decode_context_buckets(batch_ladder(128), 40960, 8, H200)
    assert buckets[1] == [256, 512, 1024, 2048, 4096, 8192, 40960]
    assert [num_splits_for(1, 1, b, 8, H200) for b in buckets[1]] == [1, 2, 4, 8, 16, 32, 33]
    assert buckets[8] == [256, 512, 1024, 40960]  # 64 programs: at most 5 splits
    assert all(buckets[s] == [40960] for s in batch_ladder(128) if s * 8 >= H200)


@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_a_round_runs_at_least_its_own_split_count_and_at_most_twice_it(kv_heads: int) -> None:
    rng = random.Random(kv_heads)
    max_len = 40000
    buckets = decode_context_buckets(batch_ladder(64), max_len, kv_heads, H200)
    for size, bounds in buckets.items():
        assert bounds == sorted(set(bounds)) and bounds[-1] == max_len
        counts = [num_splits_for(1, size, b, kv_heads, H200) for b in bounds]
        assert counts == sorted(set(counts))  # every bound its own count
        for m in [1, 255, 256, 257, 511, 512, max_len, *rng.sample(range(1, max_len + 1), 200)]:
            bound = next(b for b in bounds if b >= m)
            own, got = (num_splits_for(1, size, x, kv_heads, H200) for x in (m, bound))
            assert own <= got <= 2 * own, (size, m, bound, own, got)


class _Graph:
    def __init__(self, key: tuple[int, int], replays: list[tuple[int, int]]) -> None:
        self.key, self.replays = key, replays

    def replay(self) -> None:
        self.replays.append(self.key)


def test_a_round_replays_the_graph_of_the_first_bound_at_or_above_its_longest_context() -> None:
    engine = build_engine(static_decode=True, max_num_seqs=4, num_blocks=160, block_size=8, max_model_len=1024)
    model, cache = engine.runner.model, engine.runner.kv_cache
    static = StaticDecode(model, cache, max_num_seqs=4, max_model_len=1024,
                          context_buckets={1: [256, 512, 1024], 4: [300, 1024]})
    assert static.buckets == {1: [256, 512, 1024], 2: [1024], 4: [300, 1024]}
    replays: list[tuple[int, int]] = []
    static._graphs = {key: _Graph(key, replays) for size, bounds in static.buckets.items()  # type: ignore[misc]
                      for key in ((size, b) for b in bounds)}
    static._logits = torch.zeros(4, 8)
    for size, longest in [(1, 10), (1, 256), (1, 257), (1, 1024), (2, 3), (4, 300), (4, 301)]:
        staged = static.stage([1] * size, [longest - 1] * size, [longest] * size, [[0] * -(-longest // 8)] * size)
        batch, _ = static.load(staged)
        static.forward(batch, staged.size)
    assert replays == [(1, 256), (1, 256), (1, 512), (1, 1024), (2, 1024), (4, 300), (4, 1024)]


@pytest.mark.parametrize("bad", [{1: [512, 256, 1024]}, {1: [256, 512]}, {3: [1024]}])
def test_bad_buckets_are_refused(bad: dict[int, list[int]]) -> None:
    engine = build_engine(static_decode=True, max_num_seqs=4, num_blocks=64, max_model_len=1024)
    with pytest.raises(ConfigError, match="context_buckets"):
        StaticDecode(engine.runner.model, engine.runner.kv_cache, max_num_seqs=4, max_model_len=1024,
                     context_buckets=bad)


def test_the_builder_buckets_by_the_devices_split_target(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU the attention never splits (one bound per size); with a GPU's target the
    builder asks the split rule with the pool's KV heads."""
    import deepinfer_kit.engine.runner.static_decode as static_decode

    plain = build_engine(static_decode=True, max_num_seqs=8, num_blocks=256, max_model_len=4096)
    assert plain.runner.static is not None
    assert all(b == [4096] for b in plain.runner.static.buckets.values())
    monkeypatch.setattr(static_decode, "split_target", lambda device: H200)
    engine = build_engine(static_decode=True, max_num_seqs=8, num_blocks=256, max_model_len=4096)
    static, heads = engine.runner.static, engine.runner.kv_cache.num_kv_heads
    assert static is not None
    assert static.buckets == decode_context_buckets(static.sizes, 4096, heads, H200)
    assert len(static.buckets[1]) > 1
    # and tokens are the unbucketed engine's (on CPU both run eagerly)
    reqs: list[Any] = [(f"r{i}", [3 + (j * 7) % 250 for j in range(n)], SamplingParams(temperature=0.0, max_tokens=4))
                       for i, n in enumerate((5, 300, 600))]
    for eng in (plain, engine):
        for rid, prompt, params in reqs:
            eng.add_request(rid, prompt, params)
    assert ({o.request_id: o.outputs[0].token_ids for o in plain.run()}
            == {o.request_id: o.outputs[0].token_ids for o in engine.run()})
