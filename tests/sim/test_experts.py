"""The simulator's expert placement: the synthetic router, the real PlacementPolicy run
unchanged inside it, balancedness metrics, and the step-time penalty of imbalance."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from deepinfer_kit.cli import main
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.eplb import EplbConfig, evaluate, make_policy, placement_from_phy2log
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sim import H200, QWEN3_1_7B, AnalyticCost, LengthDist, WorkloadConfig, build_simulator, generate
from deepinfer_kit.sim.expert_records import ExpertRouting
from deepinfer_kit.sim.experts import ExpertSim, step_balancedness
from deepinfer_kit.sim.router import SyntheticRouter, inclusion_probabilities

TOKENS = [1, 7, 64, 3, 500, 2, 33, 128, 9, 1, 256, 40]


def _route_all(router: SyntheticRouter) -> list[np.ndarray]:
    return [router.route(n).copy() for n in TOKENS]


def test_router_is_seeded_and_drifts() -> None:
    a = _route_all(SyntheticRouter(3, 16, 4, drift_every=3, seed=7))
    b = _route_all(SyntheticRouter(3, 16, 4, drift_every=3, seed=7))
    c = _route_all(SyntheticRouter(3, 16, 4, drift_every=3, seed=8))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    r = SyntheticRouter(2, 16, 4, drift_every=2, seed=1)
    before = r.popularity.log_weights.clone()
    r.route(5)
    assert torch.equal(r.popularity.log_weights, before)  # no drift inside a window
    r.route(5)
    after = r.popularity.log_weights
    assert not torch.equal(after, before)
    corr = np.corrcoef(before.flatten().numpy(), after.flatten().numpy())[0, 1]
    assert corr > 0.9  # correlation 0.98 per drift step


@pytest.mark.parametrize("exponent", [0.0, 1.0, 3.0])
def test_counts_sum_to_tokens_times_top_k_and_no_expert_twice(exponent: float) -> None:
    router = SyntheticRouter(4, 16, 6, exponent=exponent, drift_every=2, seed=3)
    for n in TOKENS:
        counts = router.route(n)
        assert counts.shape == (4, 16) and counts.dtype == np.int64
        assert (counts.sum(axis=1) == n * 6).all()
        assert counts.min() >= 0 and counts.max() <= n  # a token picks an expert once
    pi = inclusion_probabilities(np.array([[0.7, 0.1, 0.1, 0.05, 0.05]]), 3)
    assert np.allclose(pi.sum(axis=1), 3.0) and pi.max() <= 1.0 and pi[0, 0] == 1.0
    with pytest.raises(ConfigError, match="top_k"):
        ExpertRouting(num_experts=4, top_k=5)


def test_policy_runs_unchanged_in_the_simulator() -> None:
    eplb = EplbConfig(window=4, interval=6, policy="refine", num_gpus=4, num_redundant=4)
    routing = ExpertRouting(num_layers=3, num_experts=16, top_k=4, exponent=1.2, drift_every=2, seed=4)
    sim = ExpertSim(eplb, routing)
    twin = SyntheticRouter(3, 16, 4, exponent=1.2, drift_every=2, seed=4)
    routed = []
    for n in TOKENS:
        sim.on_step(n, 1.0)
        routed.append(twin.route(n))
    assert sim.rebalances == 2
    window = torch.from_numpy(np.stack(routed[-4:]))  # the last 4 steps, oldest first
    direct = make_policy(eplb, 0).place(window, eplb.topology(16, 1))
    assert torch.equal(sim.placement.phy2log, direct.phy2log)
    assert torch.equal(sim.placement.logcnt, direct.logcnt)
    report = sim.report()
    assert report.rebalances == 2 and report.replicas_moved > 0
    assert 0 < report.balance_min <= report.balance_mean <= 1
    assert report.oracle_mean > report.balance_mean  # foresight beats the stale plan


def test_step_balancedness_matches_eplb_evaluate() -> None:
    phy2log = torch.tensor([[0, 1, 0, 2, 3, 1], [3, 2, 1, 0, 0, 0]])
    placement = placement_from_phy2log(phy2log, 4)
    counts = np.array([[10, 4, 0, 7], [1, 9, 30, 2]], dtype=np.int64)
    want = evaluate(placement, torch.from_numpy(counts), 3).balancedness.numpy()
    got = step_balancedness(counts, phy2log.numpy(), placement.logcnt.numpy().astype(float), 3)
    assert np.allclose(got, want)
    assert np.allclose(got, [7.0 / 9.0, 14.0 / 32.0])  # by hand: GPU loads [7, 5, 9], [32, 28/3, 2/3]
    assert step_balancedness(np.zeros((2, 4)), phy2log.numpy(), np.ones((2, 4)), 3).tolist() == [1, 1]


def _run(config: EngineConfig, routing: ExpertRouting | None) -> tuple[float, object]:
    reqs = generate(WorkloadConfig(num_requests=60, rate=400.0, seed=2,
                                   prompt_len=LengthDist("lognormal", 200, 0.5, 8, 800),
                                   output_len=LengthDist("lognormal", 30, 0.5, 1, 100)))
    sim = build_simulator(config, AnalyticCost(QWEN3_1_7B, H200), QWEN3_1_7B, routing=routing)
    report = sim.run(reqs)
    return report.busy_s, report


def test_imbalance_slows_simulated_steps() -> None:
    eplb = EplbConfig(window=4, interval=1000, num_gpus=4)  # the uniform placement stays
    routing = ExpertRouting(num_layers=2, num_experts=16, top_k=2, exponent=1.5, moe_fraction=0.4, seed=1)
    sim, twin = ExpertSim(eplb, routing), SyntheticRouter(2, 16, 2, exponent=1.5, seed=1)
    phy2log, logcnt = sim.placement.phy2log.numpy(), sim.placement.logcnt.numpy().astype(float)
    for n in TOKENS:
        b = step_balancedness(twin.route(n), phy2log, logcnt, 4)
        assert sim.on_step(n, 2.0) == pytest.approx(2.0 * (0.6 + 0.4 * float(np.mean(1.0 / b))))
    assert sim.report().slowdown_mean > 1.0

    dense = EngineConfig(num_blocks=2000, max_model_len=4096)
    moe = EngineConfig(num_blocks=2000, max_model_len=4096,
                       eplb={"policy": "deepseek", "interval": 1000, "window": 8, "num_gpus": 4})
    base, plain = _run(dense, None)
    assert plain.experts is None  # type: ignore[attr-defined]
    free, _ = _run(moe, ExpertRouting(num_experts=64, top_k=2, moe_fraction=0.0))
    assert free == pytest.approx(base, rel=1e-12)  # f = 0: the MoE part costs nothing extra
    mild, r_mild = _run(moe, ExpertRouting(num_experts=64, top_k=2, exponent=0.0))
    hot, r_hot = _run(moe, ExpertRouting(num_experts=64, top_k=2, exponent=1.5))
    assert base < mild < hot
    m, h = r_mild.experts, r_hot.experts  # type: ignore[attr-defined]
    assert h.step_balance_mean < m.step_balance_mean and h.slowdown_mean > m.slowdown_mean > 1.0
    assert "moe_balance_mean" in r_hot.summary()  # type: ignore[attr-defined]


def test_cli_sweeps_placement_policies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["sim", "--num-requests", "40", "--rate", "200", "--num-experts", "16", "--top-k", "4",
               "--eplb-gpus", "4", "--eplb-redundant", "4", "--eplb-interval", "8", "--moe-layers", "2",
               "--sweep", "eplb.policy=deepseek,refine,movement", "--no-progress"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[0] == "eplb.policy" and "moe_balance_mean" in lines[0]
    assert [ln.split()[0] for ln in lines[1:]] == ["deepseek", "refine", "movement"]
    assert main(["sim", "--num-requests", "5", "--eplb-policy", "nope", "--no-progress"]) == 2
    assert "eplb.policy" in capsys.readouterr().err
