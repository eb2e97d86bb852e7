"""WindowBlockMap.forget_idle: a full-group block allocated afresh loses the idle window it
kept from the tokens it held before (its K/V is another prefix's); held windows stay."""

from __future__ import annotations

from deepinfer_kit.cache.window_map import WindowBlockMap


def test_forget_idle_unmaps_idle_blocks_only() -> None:
    m = WindowBlockMap(4, 4)
    for full in (10, 11, 12):
        m.acquire(full)
    m.mark_inexact(12)
    m.release(10, keep=True)  # idle: a prefix hit may want it back
    m.release(12, keep=True)  # inexact: freed at release, not kept
    assert m.cached(10) and m.lookup(12) is None and m.num_available == 3
    m.forget_idle([10, 11, 99])
    assert m.lookup(10) is None and not m.cached(10)  # stale: forgotten, its block free again
    assert m.lookup(11) is not None and m.holders(11) == 1  # a window reads it: kept
    assert m.num_available == 3
    m.check([11])
    m.acquire(10)  # mapped afresh
    assert m.cached(10)
    m.check([10, 11])
