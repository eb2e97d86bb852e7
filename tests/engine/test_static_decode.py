"""The static decode path (rounds padded to a batch ladder, inputs in static buffers —
what CUDA graphs replay) gives the unpadded engine's outputs token for token; on CPU it
runs eagerly."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepinfer_kit import SamplingParams, build_engine
from deepinfer_kit.engine.runner.static_decode import batch_ladder
from deepinfer_kit.engine.runner.warmup import warm_up
from differential import run_workload, workload
from static_rounds import record_static_rounds

ROOMY = {"num_blocks": 200, "block_size": 8, "max_model_len": 96, "max_num_seqs": 13,
         "max_num_batched_tokens": 96}
PREEMPTING = {"num_blocks": 20, "block_size": 8, "max_model_len": 96, "max_num_seqs": 8,
              "max_num_batched_tokens": 64, "long_prefill_token_threshold": 24}


def test_batch_ladder() -> None:
    assert batch_ladder(1) == [1]
    assert batch_ladder(3) == [1, 2, 3]
    assert batch_ladder(8) == [1, 2, 4, 8]
    assert batch_ladder(13) == [1, 2, 4, 8, 13]
    assert batch_ladder(32) == [1, 2, 4, 8, 16, 24, 32]


@pytest.mark.parametrize("config", [ROOMY, PREEMPTING], ids=["roomy", "preempting"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("seed", [0, 1])
def test_static_decode_equals_the_unpadded_path(seed: int, overlap: bool, config: dict[str, Any]) -> None:
    """Greedy, seeded sampling, penalties, forks, stops, logprobs and prefix hits; padded
    sizes at and between the ladder rungs."""
    reqs = workload(seed, 30)
    want, plain = run_workload(reqs, overlap, static_decode=False, **config)
    assert plain.runner.static is None
    engine = build_engine(static_decode=True, overlap=overlap, **config)
    rounds = record_static_rounds(engine)
    got, _ = run_workload(reqs, overlap, engine=engine)
    assert got == want
    assert any(r.size > 1 for r in rounds), "the static path never ran"


def test_padded_rows_are_dropped_and_touch_no_live_block() -> None:
    """A round of 3 decode rows pads to 4: the scratch block takes the padded row's K/V,
    every addressable block written equals what the unpadded engine wrote."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    pools = []
    for static in (False, True):
        engine = build_engine(static_decode=static, num_blocks=24, block_size=4,
                              max_model_len=64, max_num_seqs=4, enable_prefix_caching=False)
        for i in range(3):
            engine.add_request(f"r{i}", [5 + i, 6, 7, 8, 9], params)
        if static:
            rounds = record_static_rounds(engine)
        engine.run()
        cache = engine.runner.kv_cache
        pools.append(torch.stack([cache.key_cache(i) for i in range(cache.num_layers)]))
        engine.check_idle()
    assert rounds and {r.size for r in rounds} == {4}
    torch.testing.assert_close(pools[1], pools[0])


def test_warm_up_runs_every_shape_and_leaves_the_pool_unchanged() -> None:
    engine = build_engine(static_decode=True, num_blocks=40, block_size=8, max_model_len=96,
                          max_num_seqs=8, max_num_batched_tokens=160)
    engine.add_request("a", list(range(1, 30)), SamplingParams(temperature=0.0, max_tokens=3))
    engine.run()
    cache = engine.runner.kv_cache
    before = [cache.key_cache(i).clone() for i in range(cache.num_layers)]
    warm_up(engine.runner, max_num_seqs=8, max_num_batched_tokens=160, max_model_len=96,
            capture=False)
    for i in range(cache.num_layers):
        torch.testing.assert_close(cache.key_cache(i), before[i], rtol=0, atol=0)
    engine.add_request("b", list(range(1, 30)), SamplingParams(temperature=0.0, max_tokens=3))
    engine.run()
    engine.check_idle()


def test_stage_rejects_a_round_above_the_ladder() -> None:
    engine = build_engine(static_decode=True, max_num_seqs=2, num_blocks=16, max_model_len=64)
    static = engine.runner.static
    assert static is not None and static.size_for(3) is None
    with pytest.raises(ValueError, match="exceeds the ladder"):
        static.stage([1, 2, 3], [0, 0, 0], [1, 1, 1], [[0], [0], [0]])


def test_config_fields_are_validated() -> None:
    from deepinfer_kit import ConfigError, EngineConfig

    with pytest.raises((ConfigError, TypeError), match="cuda_graphs"):
        EngineConfig(cuda_graphs="yes")  # type: ignore[arg-type]
    with pytest.raises((ConfigError, TypeError), match="static_decode"):
        EngineConfig(static_decode=1)  # type: ignore[arg-type]
    assert build_engine(cuda_graphs=True).runner.static is None  # CPU: eager by default


def test_traced_rounds_run_padded_and_count_only_real_rows() -> None:
    """A traced engine's decode rounds take the static path, and each step's routed
    counts equal the unpadded engine's (padded rows are computed but not counted)."""
    reqs = workload(3, 11)  # 11 at once: rounds pad to 13 and to the rungs below
    traces: dict[str, list[Any]] = {"plain": [], "static": []}
    plain = build_engine(static_decode=False, **ROOMY, trace=traces["plain"].append)
    want, _ = run_workload(reqs, engine=plain)
    engine = build_engine(static_decode=True, **ROOMY, trace=traces["static"].append)
    rounds = record_static_rounds(engine)
    got, _ = run_workload(reqs, engine=engine)
    assert got == want
    assert any(r.size > r.real for r in rounds), f"no padded round ran: {rounds}"
    counts = [(t.step_id, t.expert_counts) for t in traces["static"]]
    assert counts == [(t.step_id, t.expert_counts) for t in traces["plain"]]
    assert all(c is not None for _, c in counts)


def test_a_capture_failure_raises_naming_the_batch_size_and_the_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    """Capture itself needs CUDA; what it does when a size fails is checked here by making
    the capture of size 4 raise as torch does for a host sync inside a captured region."""
    from deepinfer_kit.errors import GraphCaptureError

    engine = build_engine(static_decode=True, max_num_seqs=8, num_blocks=16, max_model_len=64)
    static = engine.runner.static
    assert static is not None
    seen: list[int] = []

    def capture_one(size: int, bound: int, pool: object) -> object:
        seen.append(size)
        if size == 4:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")
        static._graphs[(size, bound)] = object()  # type: ignore[assignment]
        return pool

    monkeypatch.setattr(static, "_capture_one", capture_one)
    with pytest.raises(GraphCaptureError, match=r"batch size 4 .*operation not permitted.*cuda_graphs=False"):
        static.capture()
    assert seen == [8, 4] and static.captured_sizes == []  # nothing left half-captured
