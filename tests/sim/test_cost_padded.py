"""PaddedCost prices a round as the captured graph that runs it: padded up to the next
captured size (a staircase in the round's tokens), eager past the top; ladder_sps reads it."""

from __future__ import annotations

import pytest

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sim.cost_padded import PaddedCost, ladder_sps
from deepinfer_kit.sim.cost_saturating import SaturatingCost
from deepinfer_kit.sim.records import StepShape


def _decode(b: int, spec: int = 0, prefill: int = 0) -> StepShape:
    return StepShape(prefill, b, b, b, b, b, spec)


def test_rounds_cost_the_next_captured_size_and_run_eagerly_past_the_top() -> None:
    inner = SaturatingCost(memory_s=0.0, token_s=1.0)  # one second per token: prices = tokens
    cost = PaddedCost(inner, [4, 8, 16])
    assert [cost.step_time(_decode(b)) for b in (1, 4, 5, 8, 9, 16)] == [4, 4, 8, 8, 16, 16]
    assert cost.step_time(_decode(3, spec=2)) == 8  # verified drafts count as tokens
    assert cost.step_time(_decode(2, prefill=3)) == 8  # a mixed round is padded too
    assert cost.step_time(_decode(17)) == 17  # past the top: eager, unpadded
    padded = cost.padded(_decode(5))
    assert (padded.num_decode_rows, padded.num_sampled_rows, padded.num_chunks) == (8, 8, 8)
    assert cost.padded(_decode(8)) == _decode(8)


def test_ladder_sps_is_the_staircase_of_the_captured_sizes() -> None:
    cost = PaddedCost(SaturatingCost(memory_s=2.0, token_s=0.25), [4, 8, 16])
    sps = ladder_sps(cost)
    assert sps.staircase and sps.batch_tokens == (4, 8, 16)
    assert [sps.step_time(b) for b in (1, 4, 5, 9, 16)] == [2.0, 2.0, 2.0, 4.0, 4.0]
    for b in range(1, 17):  # the curve is the cost of a decode round of b tokens
        assert sps.step_time(b) == pytest.approx(cost.step_time(_decode(b)))


@pytest.mark.parametrize("sizes", [[], [0, 4], [4, 4], [8, 4]])
def test_bad_ladders_are_refused(sizes: list[int]) -> None:
    with pytest.raises(ConfigError, match="sizes"):
        PaddedCost(SaturatingCost(1.0, 1.0), sizes)
