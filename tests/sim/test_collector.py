"""quiet_collector: the collector is tuned inside the block and restored after it, also
when the block raises; cycles made inside are still collected."""

from __future__ import annotations

import gc

import pytest

from deepinfer_kit.sim.collector import quiet_collector


class _Node:
    def __init__(self) -> None:
        self.other: object = self


def test_collector_is_tuned_inside_and_restored_after() -> None:
    before = gc.get_threshold()
    alive = _Node()
    with quiet_collector(12_345):
        assert gc.get_threshold() == (12_345, before[1], before[2])
        assert gc.get_freeze_count() > 0  # what was alive at entry is frozen
        cycle = _Node()
        del cycle
        assert gc.collect() >= 1  # collection still runs and finds new cycles
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError), quiet_collector(777):
        raise RuntimeError("boom")
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    assert alive.other is alive
