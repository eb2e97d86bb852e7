"""KV tiers with the model in worker processes: each rank's worker holds its heads' host
slab in shared memory, which the scheduler side maps. Tokens equal the same workers'
without tiers (one rank and two tensor-parallel ranks, greedy and seeded); a disk file
written under one tensor-parallel size is read under another; a load that fails on one
rank ends exactly the requests that read it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deepinfer_kit.disagg import build_disaggregated
from deepinfer_kit.engine.build import build_engine
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.errors import ConfigError
from differential import run_workload, workload
from runner_hooks import FailLoadsOnRank
from tier_workload import POOL, a_failed_load_errors_its_request, serve_one_at_a_time, tier_params, tier_prompts

_HEADS, _PROMPTS, _RNG = tier_prompts(11, 4, 12)
_POOL = POOL


def _serve(**kw: Any) -> tuple[dict[str, list[int]], Any]:
    return serve_one_at_a_time(_PROMPTS, **kw)


@pytest.mark.parametrize("ranks, tiers", [
    pytest.param({}, {"host_blocks": 12, "disk_blocks": 120}, id="one_worker_disk"),
    # host only on two TP ranks: the differential test below covers it by default
    pytest.param({"tensor_parallel": 2}, {"host_blocks": 64}, id="tp2_host", marks=pytest.mark.slow),
    pytest.param({"tensor_parallel": 2}, {"host_blocks": 12, "disk_blocks": 120, "write_policy": "write_back"},
                 id="tp2_disk_back"),
    # replicated heads: RankSlabs' unit tests cover them by default
    pytest.param({"expert_parallel": 2}, {"host_blocks": 12, "disk_blocks": 120}, id="ep2_disk",
                 marks=pytest.mark.slow),
])
def test_tokens_equal_the_same_workers_without_tiers(ranks: dict[str, Any], tiers: dict[str, Any],
                                                     tmp_path: Path) -> None:
    if "disk_blocks" in tiers:
        tiers = {**tiers, "disk_path": str(tmp_path)}
    reference, _ = _serve(worker="process", **ranks)
    got, stats = _serve(worker="process", kv_tiers=tiers, **ranks)
    assert got == reference
    assert stats.loaded_tokens > 0
    if "disk_blocks" in tiers:
        assert stats.disk_hits > 0 and stats.saved_disk > 0


def test_the_differential_workload_under_two_ranks_with_tiers() -> None:
    """Forks, penalties, logprobs, stops, chunked prefill and preemption, with evicted
    prefixes coming back from the host tier of two tensor-parallel ranks."""
    reqs = workload(31, 14)
    again = [(f"{rid}-again", prompt, params) for rid, prompt, params in reversed(reqs)]  # evicted by now
    pool = {"num_blocks": 40, "block_size": 8, "max_model_len": 96, "max_num_seqs": 6,
            "max_num_batched_tokens": 48, "long_prefill_token_threshold": 16}
    outcomes = []
    for tiers in (None, {"host_blocks": 64}):
        first, engine = run_workload(reqs, worker="process", tensor_parallel=2, kv_tiers=tiers, **pool)
        try:
            second, _ = run_workload(again, engine=engine)
            outcomes.append((first, second, getattr(engine.cache, "tier_stats", None)))
        finally:
            engine.close()
    (want1, want2, _), (got1, got2, stats) = outcomes
    assert got1 == want1 and got2 == want2
    assert stats.loaded_tokens > 0


def test_a_disk_block_written_under_two_ranks_is_read_under_one(tmp_path: Path) -> None:
    # The files hold whole blocks, every head in order: the decode side (one rank, in this
    # process) takes all heads of what the prefill side's two ranks wrote, each its half.
    config = EngineConfig(num_blocks=64, block_size=8, max_num_seqs=4, max_model_len=256)
    plain = build_engine(config)
    for i, p in enumerate(_PROMPTS):
        plain.add_request(str(i), p, tier_params(i))
    reference = {o.request_id: list(o.outputs[0].token_ids) for o in plain.run()}
    plain.close()
    d = build_disaggregated(config, tmp_path, prefill={"worker": "process", "tensor_parallel": 2})
    for i, p in enumerate(_PROMPTS):
        d.add_request(str(i), p, tier_params(i))
    got = {o.request_id: list(o.outputs[0].token_ids) for o in d.run()}
    d.prefill.check_idle()
    d.decode.check_idle()
    assert d.decode.cache.tier_stats.disk_hits > 0  # type: ignore[attr-defined]
    assert d.num_fallbacks == 0
    d.close()
    assert got == reference


def test_a_load_failing_on_one_rank_errors_its_requests() -> None:
    engine = build_engine(**_POOL, worker="process", tensor_parallel=2, kv_tiers={"host_blocks": 64},
                          worker_setup=FailLoadsOnRank(1))
    a_failed_load_errors_its_request(engine, _HEADS[0], [[_RNG.randrange(250) for _ in range(70)] for _ in range(3)])
    engine.flush()
    engine.check_idle()
    engine.close()


def test_an_injected_connector_is_refused_with_a_worker_process() -> None:
    from deepinfer_kit.components import Components, Factory

    with pytest.raises(ConfigError, match="kv_connector .* worker='process' use kv_tiers"):
        build_engine(worker="process", components=Components(kv_connector=Factory(lambda ctx: None)))


@pytest.mark.slow  # the in-process speculative case runs by default (test_kv_tiers_engine.py)
def test_a_speculative_worker_with_tiers_gives_the_same_greedy_tokens(tmp_path: Path) -> None:
    # Greedy only: a seeded draw under speculation follows how many drafts each round
    # verifies, which loaded tokens change (tests/engine/test_kv_tiers_engine.py says why).
    spec = {"drafter": "ngram", "num_draft": 3}
    reference, _ = _serve(worker="process", speculative=spec)
    got, stats = _serve(worker="process", speculative=spec,
                        kv_tiers={"host_blocks": 12, "disk_blocks": 120, "disk_path": str(tmp_path)})
    assert {k: v for k, v in got.items() if int(k) % 2} == {k: v for k, v in reference.items() if int(k) % 2}
    assert stats.disk_hits > 0
