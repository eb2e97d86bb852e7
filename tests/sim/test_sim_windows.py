"""Sliding-window layers in the simulator: the shape counts what a windowed layer reads, the
analytic cost prices the sliding layers' KV reads and attention by the window, and the pool
holds the sliding layers' windows in the hybrid cache's pools (more sequences fit)."""

from __future__ import annotations

import random

import attrs
import pytest

from deepinfer_kit.cache.hybrid_manager import HybridKVCacheManager
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sched.records import ScheduledChunk, SchedulePlan
from deepinfer_kit.sim.build import build_simulator
from deepinfer_kit.sim.cost_analytic import H200, QWEN3_1_7B, AnalyticCost, ModelShape
from deepinfer_kit.sim.lengths import LengthDist
from deepinfer_kit.sim.records import StepShape
from deepinfer_kit.sim.shape import plan_shape
from deepinfer_kit.sim.workload import WorkloadConfig, generate

# Gemma-3-like: 5 in 6 layers slide over 512 tokens.
WINDOWED = attrs.evolve(QWEN3_1_7B, num_layers=24, sliding_window=512, sliding_layers=20)


def _chunk(start: int, n: int) -> ScheduledChunk:
    return ScheduledChunk("r", start, n, list(range(n)), [0], sample=True)


@pytest.mark.parametrize("seed", range(5))
def test_window_reads_equal_a_per_query_count(seed: int) -> None:
    rng = random.Random(seed)
    window = rng.choice([1, 3, 16, 100])
    chunks = [_chunk(rng.randrange(300), rng.randint(1, 60)) for _ in range(6)]
    shape = plan_shape(SchedulePlan(0, chunks), window)
    pairs = sum(min(p + 1, window) for c in chunks for p in range(c.start, c.start + c.num_tokens))
    keys = sum(len({k for p in range(c.start, c.start + c.num_tokens) for k in range(max(0, p - window + 1), p + 1)})
               for c in chunks)
    assert (shape.window_attention_pairs, shape.num_window_context_tokens) == (pairs, keys)
    assert plan_shape(SchedulePlan(0, chunks)).num_window_context_tokens == 0


def test_sliding_layers_cost_less_only_past_the_window() -> None:
    full = AnalyticCost(attrs.evolve(WINDOWED, sliding_window=None, sliding_layers=0), H200)
    windowed = AnalyticCost(WINDOWED, H200)

    def decode(ctx: int) -> SchedulePlan:
        return SchedulePlan(0, [_chunk(ctx, 1) for _ in range(64)])

    short, long = decode(200), decode(8000)
    assert windowed.step_time(plan_shape(short, 512)) == pytest.approx(full.step_time(plan_shape(short)))
    assert windowed.step_time(plan_shape(long, 512)) < 0.5 * full.step_time(plan_shape(long))
    with pytest.raises(ConfigError, match="sliding layers"):
        windowed.decode_round_times(4, 100, 0.0, 1.0, 3)
    with pytest.raises(ConfigError, match="sliding_layers"):
        attrs.evolve(WINDOWED, sliding_layers=25)
    assert StepShape().window_attention_pairs == 0


def test_long_context_serving_fits_more_sequences_with_windows() -> None:
    """Same KV memory, long prompts: the hybrid pools hold the sliding layers' windows only,
    so more sequences run at once, none preempted, every block returned."""
    reqs = generate(WorkloadConfig(num_requests=48, rate=1e9, seed=3,
                                   prompt_len=LengthDist("fixed", 6000, 0.0, 6000, 6000),
                                   output_len=LengthDist("fixed", 64, 0.0, 64, 64)))
    config = EngineConfig(kv_cache_memory_mb=6 * 1024, max_model_len=8192, max_num_seqs=32)
    reports = {}
    for name, model in (("full", attrs.evolve(WINDOWED, sliding_window=None, sliding_layers=0)),
                        ("windowed", WINDOWED)):
        sim = build_simulator(config, AnalyticCost(model, H200), model)
        assert isinstance(sim.cache, HybridKVCacheManager) == (name == "windowed")
        reports[name] = sim.run(reqs)
        sim.cache.check_integrity(())
        assert sim.cache.num_free_blocks == sim.cache.num_blocks
    full, windowed = reports["full"], reports["windowed"]
    assert full.num_finished == windowed.num_finished == 48
    assert windowed.summary()["duration_s"] < full.summary()["duration_s"]
