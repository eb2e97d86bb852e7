"""SPS profiling at engine build: the fitted curve from a runner whose step time is known
(a fake clock advanced by the fake model), the fit's cleanup, and the opt-in engine path."""

from __future__ import annotations

import attrs
import pytest
import torch

from deepinfer_kit import build_engine
from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.spec.speculation import build_speculation
from deepinfer_kit.engine.runner.sps_profile import (
    fit_sps, forward_timer, knee_interval, measure_sps, sps_points, verify_shape,
)
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.spec.planners import DSparkPlanner
from deepinfer_kit.spec.records import SpecConfig, SpsCurve


def _step_seconds(tokens: int) -> float:
    """A saturating device: flat up to 8 tokens, then linear."""
    return 0.010 + 0.001 * max(0, tokens - 8)


@attrs.define
class _Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@attrs.define
class _FakeModel:
    """Advances the clock by the known step time of the tokens it is fed."""

    clock: _Clock
    fed: list[tuple[int, int]] = attrs.field(factory=list)

    def __call__(self, forward, cache):  # type: ignore[no-untyped-def]
        tokens = int(forward.input_ids.shape[0])
        self.fed.append((tokens, int(forward.attn.slot_mapping.unique().numel())))
        self.clock.now += _step_seconds(tokens)
        return torch.zeros(1, 4)


@attrs.define
class _FakeRunner:
    model: _FakeModel
    kv_cache: PagedKVCache
    device: torch.device = torch.device("cpu")


def test_profiled_curve_equals_the_known_step_time() -> None:
    clock = _Clock()
    runner = _FakeRunner(_FakeModel(clock), PagedKVCache(1, 8, 16, 1, 4, dtype=torch.float32, device="cpu"))
    points = sps_points(40)
    curve = measure_sps(forward_timer(runner, chunk=5, clock=clock), points)  # type: ignore[arg-type]
    # powers of two, then the knee bisected: 16 is the first count 25% slower than 1, so
    # 12 (slower), 10 (not), 11 (not) locate it between 11 and 12
    assert curve.batch_tokens == (1, 2, 4, 8, 10, 11, 12, 16, 32, 40)
    for b in range(1, 41):  # the time is piecewise linear, so exact between the points too
        assert curve(b) == pytest.approx(1.0 / _step_seconds(b))
    assert curve(80) == pytest.approx(1.0 / _step_seconds(80))  # extended along the last slope
    # one untimed call and three timed ones per point, every K/V write to the pad slot
    assert [t for t, _ in runner.model.fed] == [b for b in (*points, 12, 10, 11) for _ in range(4)]
    assert {slots for _, slots in runner.model.fed} == {1}


def test_the_knee_is_the_first_rise_over_the_flat_part() -> None:
    assert knee_interval([1, 2, 4, 8], [1.0, 1.0, 1.1, 2.0]) == (4, 8)
    assert knee_interval([1, 2, 4, 8], [1.0, 1.0, 1.1, 1.2]) is None  # never rises enough
    assert knee_interval([1, 2, 4], [1.0, 3.0, 4.0]) is None  # nothing between 1 and 2


def test_fit_takes_the_median_and_never_lets_a_larger_step_be_faster() -> None:
    curve = fit_sps([1, 2, 4], [[0.010, 0.030, 0.011], [0.008, 0.009, 0.0085], [0.020]])
    assert curve.steps_per_second == pytest.approx((1 / 0.011, 1 / 0.011, 1 / 0.020))
    with pytest.raises(ConfigError, match="fit_sps"):
        fit_sps([1, 2], [[0.01]])
    with pytest.raises(ConfigError, match="> 0"):
        fit_sps([1], [[0.0]])


def test_points_and_shapes() -> None:
    assert sps_points(1) == [1]
    assert sps_points(2048) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
    assert sps_points(48) == [1, 2, 4, 8, 16, 32, 48]
    query, seq = verify_shape(13, chunk=5, context=10)
    assert query == [5, 4, 4] and seq == [15, 14, 14]
    assert verify_shape(3, chunk=5, context=0) == ([3], [3])


def test_engine_profiles_the_dspark_curve_unless_one_is_given() -> None:
    spec = {"drafter": "ngram", "num_draft": 3, "planner": "dspark"}
    engine = build_engine(speculative=spec, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
                          max_model_len=512)
    assert engine.runner.drafting is not None
    planner = engine.runner.drafting.speculation.planner
    assert isinstance(planner, DSparkPlanner)
    # the whole budget, not only max_num_seqs * (1 + γ): prefill rides in the same rounds
    assert {1, 2, 4, 8, 16, 32, 64} <= set(planner.sps.batch_tokens)
    assert planner.sps.batch_tokens[-1] == 64
    sps = planner.sps.steps_per_second
    assert all(b <= a for a, b in zip(sps, sps[1:]))
    given = SpsCurve((1, 8), (50.0, 40.0))
    engine = build_engine(speculative={**spec, "sps": given}, num_blocks=64, max_model_len=512)
    assert engine.runner.drafting is not None and engine.runner.drafting.speculation.planner.sps is given  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="speculative.sps"):
        SpecConfig(sps="measure")
    with pytest.raises(ConfigError, match="speculative.sps: planner='dspark' needs an SpsCurve"):
        build_speculation(SpecConfig(planner="dspark"))
