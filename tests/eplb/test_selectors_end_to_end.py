"""Replica selectors end to end under skewed routing: the greedy tokens are the same under
every selector and equal the engine's without EPLB, and the balanced selector spreads the
expert copies over the GPUs at least as evenly as the static rule (counted, not timed).
In one process over 2 virtual GPUs (default tier) and on 2 expert-parallel gloo ranks
(slow: three engines of two worker processes each)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from deepinfer_kit import SamplingParams, build_engine
from deepinfer_kit.engine.runner.balance import moe_layers
from deepinfer_kit.engine.runner.model_runner import ModelRunner
from deepinfer_kit.testing.eplb_probe import Probe

POOL = {"num_blocks": 48, "block_size": 8, "max_model_len": 64, "max_num_seqs": 4, "max_num_batched_tokens": 64}
EPLB = {"window": 3, "interval": 2, "num_redundant": 2, "num_gpus": 2, "policy": "deepseek"}
SELECTORS = ("static", "even", "balanced")


class _GpuLoads(Probe):
    """The probe's skew, plus (in one process) each MoE call's copies per virtual GPU."""

    def __call__(self, runner: ModelRunner) -> None:
        super().__call__(runner)
        self.calls: list[tuple[int, ...]] = []
        for layer in moe_layers(runner.model):
            layer.register_forward_hook(self._loads)

    def _loads(self, layer: Any, args: Any, out: Any) -> None:
        if layer.last_slot_counts is not None:
            self.calls.append(tuple(layer.last_slot_counts.view(2, -1).sum(1).tolist()))


def _serve(probe: Probe, **config: Any) -> list[list[int]]:
    engine = build_engine(worker_setup=probe, **POOL, **config)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    try:
        ids = [engine.add_request(None, list(range(5 * i, 5 * i + 12)), params) for i in range(4)]
        done = {o.request_id: o for o in engine.run()}
        engine.check_idle()
        if engine.balancer is not None:
            assert len(engine.balancer.history) >= 2  # the selectors ran under replicated placements
    finally:
        engine.close()
    return [done[i].outputs[0].token_ids for i in ids]


def _balancedness(calls: list[tuple[int, ...]]) -> float:
    """Copies-weighted mean / max copies per GPU over the MoE calls that ran any."""
    busy = [c for c in calls if max(c) > 0]
    return sum(sum(c) / len(c) for c in busy) / sum(max(c) for c in busy)


def _check(balance: dict[str, float]) -> None:
    assert balance["balanced"] >= balance["static"], balance
    assert balance["balanced"] > 0.95, balance


def test_selectors_in_one_process_keep_the_tokens_and_balanced_spreads_the_copies(tmp_path: Path) -> None:
    want = _serve(Probe(str(tmp_path), 0.7, 1))
    balance = {}
    for dispatch in SELECTORS:
        probe = _GpuLoads(str(tmp_path), 0.7, 1)
        assert _serve(probe, eplb={**EPLB, "dispatch": dispatch}) == want, dispatch
        balance[dispatch] = _balancedness(probe.calls)
    _check(balance)


@pytest.mark.slow
def test_selectors_on_expert_parallel_ranks_keep_the_tokens_and_balanced_spreads_the_copies(tmp_path: Path) -> None:
    want = _serve(Probe(str(tmp_path), 0.7, 1))
    balance = {}
    for dispatch in SELECTORS:
        out = tmp_path / dispatch
        out.mkdir()
        got = _serve(Probe(str(out), 0.7, 1), worker="process", expert_parallel=2, eplb={**EPLB, "dispatch": dispatch})
        assert got == want, dispatch
        ranks = [json.loads((out / f"rank{r}.json").read_text())["copies"] for r in range(2)]
        balance[dispatch] = _balancedness(list(zip(*ranks)))
    _check(balance)
