"""The simulator takes the same Components as the engine (host kinds, the cost model and the
placement policy), builds its factories with its virtual clock, and reports their effect."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from deepinfer_kit.components import Components, Factory
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sim import H200, QWEN3_1_7B, AnalyticCost, LengthDist, WorkloadConfig, build_simulator, generate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import own_components as own  # noqa: E402

REQS = generate(WorkloadConfig(num_requests=120, seed=2, rate=400.0, shared_fraction=0.5, multi_turn_fraction=0.3,
                               prompt_len=LengthDist("lognormal", 200, 0.5, 16, 1000),
                               output_len=LengthDist("lognormal", 30, 0.5, 1, 100)))
CONFIG = EngineConfig(num_blocks=300, max_model_len=2048)


def _sim(parts: Components, cost: object | None = None, config: EngineConfig = CONFIG):  # type: ignore[no-untyped-def]
    return build_simulator(config, cost if cost is not None or parts.cost_model is not None else
                           AnalyticCost(QWEN3_1_7B, H200), QWEN3_1_7B, components=parts)  # type: ignore[arg-type]


def test_a_scheduler_factory_gets_the_virtual_clock() -> None:
    sim = _sim(Components(scheduler=Factory(own.CountingScheduler)))
    report = sim.run(REQS)
    assert isinstance(sim.scheduler, own.CountingScheduler)
    assert 0 < sim.scheduler.rounds <= report.num_steps  # plain-decode stretches skip schedule()
    assert report.num_finished == len(REQS)
    # Stamped on the virtual clock (the wall clock would put TTFTs in the thousands of seconds):
    # the same scheduling rule as the built-in gives the very same report.
    built_in = _sim(Components()).run(REQS).summary()
    mine = report.summary()
    built_in.pop("wall_s"), mine.pop("wall_s")
    assert mine == built_in


def test_an_eviction_policy_and_an_admission_policy_run_in_the_simulator() -> None:
    policy = own.MRUEvictionPolicy()
    lru = _sim(Components()).run(REQS)
    mru = _sim(Components(eviction_policy=policy, admission_policy=own.shortest_prompt_first)).run(REQS)
    assert policy.evicted and mru.num_finished == len(REQS)
    assert (mru.prefix_hit_rate, mru.ttft.p50) != (lru.prefix_hit_rate, lru.ttft.p50)


def test_a_cost_model_prices_every_round() -> None:
    report = _sim(Components(cost_model=own.ConstantCost(0.01))).run(REQS)
    assert report.busy_s == pytest.approx(0.01 * report.num_steps)
    with pytest.raises(ConfigError, match="one cost model.*both"):
        _sim(Components(cost_model=own.ConstantCost()), cost=own.ConstantCost())


def test_a_placement_policy_plans_the_simulated_experts() -> None:
    policy = own.FrozenPlacementPolicy()
    config = EngineConfig(num_blocks=400, max_model_len=4096,
                          eplb={"window": 4, "interval": 4, "num_redundant": 8, "num_gpus": 8})
    sim = _sim(Components(placement_policy=policy), config=config)
    sim.run(REQS)
    assert policy.calls > 0


def test_device_components_are_refused() -> None:
    with pytest.raises(ConfigError, match="sampler runs beside a model"):
        _sim(Components(sampler=own.SecondBestSampler()))
