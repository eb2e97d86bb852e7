"""KV tiers in the simulator: the engine's tiers' scheduler side over counted slots and
keys; their copies priced by the cost model; no torch needed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import attrs

from deepinfer_kit.cache.tiers.manager import TieredKVCacheManager, tiered
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.sim.build import build_simulator
from deepinfer_kit.sim.cost_analytic import H200, QWEN3_1_7B, AnalyticCost
from deepinfer_kit.sim.lengths import LengthDist
from deepinfer_kit.sim.records import StepShape
from deepinfer_kit.sim.workload import WorkloadConfig, generate

_WORK = WorkloadConfig(num_requests=160, seed=2, rate=40.0, multi_turn_fraction=1.0, turns=8, think_time=0.5,
                       prompt_len=LengthDist("lognormal", 600.0, 0.5), output_len=LengthDist("fixed", 40.0),
                       followup_len=LengthDist("lognormal", 80.0, 0.5))


def _run(tiers: dict[str, object] | None) -> tuple[float, object]:
    config = EngineConfig(num_blocks=700, block_size=16, max_num_seqs=32, max_model_len=8192, kv_tiers=tiers)
    sim = build_simulator(config, AnalyticCost(QWEN3_1_7B, H200), QWEN3_1_7B)
    report = sim.run(generate(_WORK))
    cache = sim.cache
    cache.check_integrity(())
    assert report.num_finished == _WORK.num_requests
    return report.prefix_hit_rate, cache.tier_stats if isinstance(cache, TieredKVCacheManager) else None


def test_tiers_raise_the_hit_rate_of_a_workload_the_pool_cannot_hold() -> None:
    device, _ = _run(None)
    host, host_stats = _run({"host_blocks": 1400})
    disk, disk_stats = _run({"host_blocks": 700, "disk_blocks": 20000, "disk_path": "never-created"})
    assert device < host and device < disk
    assert host_stats.host_hits > 0 and disk_stats.disk_hits > 0  # type: ignore[attr-defined]
    assert not Path("never-created").exists()


def test_transfers_are_priced_at_the_host_bandwidth() -> None:
    cost = AnalyticCost(QWEN3_1_7B, H200)
    shape = StepShape(num_prefill_tokens=100, num_context_tokens=100, num_sampled_rows=1, num_chunks=1)
    moved = attrs.evolve(shape, num_kv_transfer_tokens=1600)
    extra = cost.step_time(moved) - cost.step_time(shape)
    assert abs(extra - 1600 * QWEN3_1_7B.kv_bytes_per_token / H200.host_bandwidth) < 1e-12


def test_the_simulated_tiers_import_no_torch() -> None:
    code = textwrap.dedent("""
        import importlib.abc, sys
        class Refuse(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] in ("torch", "triton"):
                    raise ModuleNotFoundError(name)
        sys.meta_path.insert(0, Refuse())
        from deepinfer_kit.engine.config import EngineConfig
        from deepinfer_kit.sim.tiers import sim_tiers
        c = sim_tiers(EngineConfig(kv_tiers={"host_blocks": 4, "disk_blocks": 8, "disk_path": "x"}), 16)
        assert c is not None
    """)
    src = Path(__file__).resolve().parents[2] / "src"
    subprocess.run([sys.executable, "-c", code], check=True, env={"PYTHONPATH": str(src), "PATH": ""})


def test_a_hybrid_cache_moves_and_prices_every_layer() -> None:
    """Gemma-3-like (5 sliding layers in 6, window 64): the tiers under the hybrid cache
    keep every layer of a block (the sliding layers' windows too), so a hit from a tier
    needs no replay, and its copies are priced at every layer's bytes."""
    model = attrs.evolve(QWEN3_1_7B, num_layers=24, sliding_window=64, sliding_layers=20)
    cost = AnalyticCost(model, H200)
    shape = StepShape(num_prefill_tokens=100, num_context_tokens=100, num_sampled_rows=1, num_chunks=1,
                      num_kv_transfer_tokens=1600)
    bare = attrs.evolve(shape, num_kv_transfer_tokens=0)
    assert abs(cost.step_time(shape) - cost.step_time(bare) - 1600 * model.kv_bytes_per_token / H200.host_bandwidth) < 1e-12

    config = EngineConfig(num_blocks=700, block_size=16, max_num_seqs=32, max_model_len=8192,
                          max_num_batched_tokens=2048, kv_tiers={"host_blocks": 1400})
    recording = _Recording(model, H200)
    sim = build_simulator(config, recording, model)
    seen = recording.seen
    report = sim.run(generate(_WORK))
    assert report.num_finished == _WORK.num_requests
    assert any(s.num_kv_transfer_tokens for s in seen)
    stats = tiered(sim.cache).tier_stats  # type: ignore[union-attr]
    windows = sim.cache.window_stats  # type: ignore[attr-defined]
    assert stats.host_hits > 0 and stats.failed_reads == 0
    assert windows.replayed_tokens < stats.loaded_tokens  # tier hits came with their windows


class _Recording(AnalyticCost):
    """The analytic cost, keeping every shape it priced."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.seen: list[StepShape] = []

    def step_time(self, shape: StepShape) -> float:
        self.seen.append(shape)
        return super().step_time(shape)


def test_layerwise_loads_are_priced_beside_the_forward() -> None:
    """Loads that land layer by layer cost the first layer's copy plus what the rest take
    beyond the forward; saves (and whole-round loads) stay before it."""
    cost = AnalyticCost(QWEN3_1_7B, H200)
    per_token = QWEN3_1_7B.kv_bytes_per_token / H200.host_bandwidth
    layers = QWEN3_1_7B.num_layers
    bare = StepShape(num_prefill_tokens=512, num_context_tokens=512, num_sampled_rows=1, num_chunks=1,
                     attention_pairs=512 * 513 // 2)
    forward = cost.step_time(bare)
    for loads in (160, 1_600_000):  # copies shorter than the forward, then far longer
        whole = attrs.evolve(bare, num_kv_transfer_tokens=loads)
        beside = attrs.evolve(whole, num_kv_layerwise_load_tokens=loads)
        copy = loads * per_token
        assert abs(cost.step_time(whole) - forward - copy) < 1e-12
        want = copy / layers + max(0.0, copy * (layers - 1) / layers - (forward - H200.step_overhead_s))
        assert abs(cost.step_time(beside) - forward - want) < 1e-9
        assert cost.step_time(beside) < cost.step_time(whole)


def test_the_simulator_marks_loads_layerwise_as_the_engine_runs_them() -> None:
    marked = {}
    for layerwise in (True, False):
        config = EngineConfig(num_blocks=700, block_size=16, max_num_seqs=32, max_model_len=8192,
                              kv_tiers={"host_blocks": 1400, "layerwise_loads": layerwise})
        recording = _Recording(QWEN3_1_7B, H200)
        sim = build_simulator(config, recording, QWEN3_1_7B)
        sim.run(generate(_WORK))
        loads = [s for s in recording.seen if s.num_kv_transfer_tokens]
        assert loads
        marked[layerwise] = sum(s.num_kv_layerwise_load_tokens for s in loads)
    assert marked[True] > 0 and marked[False] == 0


def test_a_model_whose_every_layer_slides_keeps_its_windows_in_the_tiers() -> None:
    """Every layer sliding: the full group's blocks are names only, the tiers keep the
    sliding layers' windows and serve hits, as the engine does."""
    model = attrs.evolve(QWEN3_1_7B, num_layers=24, sliding_window=64, sliding_layers=24)
    config = EngineConfig(num_blocks=700, block_size=16, max_num_seqs=32, max_model_len=8192,
                          max_num_batched_tokens=2048, kv_tiers={"host_blocks": 1400})
    sim = build_simulator(config, AnalyticCost(model, H200), model)
    report = sim.run(generate(_WORK))
    assert report.num_finished == _WORK.num_requests
    assert tiered(sim.cache).tier_stats.host_hits > 0  # type: ignore[union-attr]
