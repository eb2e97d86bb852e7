"""HybridKVCacheManager: the KVCacheManager suite through its groups (windows too long to
slide: every call passes through the sliding group's bookkeeping and must change nothing
the full group's manager decides), and the sliding-window suite (windows that slide)."""

from __future__ import annotations

import pytest

from deepinfer_kit.cache import BlockKVCacheManager, FreeListBlockAllocator, RadixPrefixIndex
from deepinfer_kit.cache.hash_chain_index import HashChainPrefixIndex
from deepinfer_kit.cache.hybrid_manager import HybridKVCacheManager
from deepinfer_kit.cache.layer_groups import KVLayout
from deepinfer_kit.testing.cache import KV_CACHE_MANAGER_SUITE
from deepinfer_kit.testing.hybrid_cache import HYBRID_KV_CACHE_MANAGER_SUITE
from deepinfer_kit.testing.suite import Check

INDEXES = {"hash": HashChainPrefixIndex, "radix": RadixPrefixIndex}


def _hybrid(kind: str, num_blocks: int, block_size: int, layout: KVLayout, sliding: int,
            replay_limit: int = 0) -> HybridKVCacheManager:
    inner = BlockKVCacheManager(FreeListBlockAllocator(num_blocks, block_size), INDEXES[kind](block_size))
    return HybridKVCacheManager(inner, layout, sliding, replay_limit=replay_limit)


@pytest.mark.parametrize("check", KV_CACHE_MANAGER_SUITE.checks, ids=KV_CACHE_MANAGER_SUITE.ids)
def test_plain_manager_suite_through_the_groups(check: Check[object]) -> None:
    layout = KVLayout.from_windows([None, 10_000])
    check(lambda num_blocks, block_size: _hybrid("radix", num_blocks, block_size, layout, 4 * num_blocks + 4))


@pytest.mark.parametrize("kind", sorted(INDEXES))
@pytest.mark.parametrize("check", HYBRID_KV_CACHE_MANAGER_SUITE.checks, ids=HYBRID_KV_CACHE_MANAGER_SUITE.ids)
def test_sliding_window_suite(check: Check[object], kind: str) -> None:
    check(lambda num_blocks, block_size, layout, sliding, replay: _hybrid(kind, num_blocks, block_size, layout,
                                                                        sliding, replay))


def _over_tiers(num_blocks: int, block_size: int, layout: KVLayout, sliding: int,
                replay_limit: int = 0, *, windows: bool = False, policy: str = "write_through") -> HybridKVCacheManager:
    """The hybrid manager over a full group with a host tier under it (the engine's tiers'
    scheduler side over counted slots): prefixes the small pool lost come back from the
    tier into blocks whose old windows must be forgotten — with their windows
    (``windows``: :class:`TieredHybridKVCacheManager`, what the engine builds), or
    replayed (a :class:`HybridKVCacheManager` over tiers that keep the full group only)."""
    from deepinfer_kit.cache.tiers.bytes import NoBytes
    from deepinfer_kit.cache.tiers.config import TierConfig
    from deepinfer_kit.cache.tiers.hybrid import TieredHybridKVCacheManager
    from deepinfer_kit.cache.tiers.manager import TieredKVCacheManager
    from deepinfer_kit.cache.tiers.offload import OffloadConnector

    connector = OffloadConnector(TierConfig(host_blocks=4 * num_blocks, write_policy=policy), NoBytes(), None,
                                 block_size)
    inner = TieredKVCacheManager(FreeListBlockAllocator(num_blocks, block_size), RadixPrefixIndex(block_size),
                                 connector)
    if windows:
        return TieredHybridKVCacheManager(inner, layout, sliding, replay_limit=replay_limit)
    return HybridKVCacheManager(inner, layout, sliding, replay_limit=replay_limit)


def _over_windowed_tiers(num_blocks: int, block_size: int, layout: KVLayout, sliding: int,
                         replay_limit: int = 0) -> HybridKVCacheManager:
    return _over_tiers(num_blocks, block_size, layout, sliding, replay_limit, windows=True)


def _over_windowed_write_back(num_blocks: int, block_size: int, layout: KVLayout, sliding: int,
                              replay_limit: int = 0) -> HybridKVCacheManager:
    return _over_tiers(num_blocks, block_size, layout, sliding, replay_limit, windows=True, policy="write_back")


@pytest.mark.parametrize("check", HYBRID_KV_CACHE_MANAGER_SUITE.checks, ids=HYBRID_KV_CACHE_MANAGER_SUITE.ids)
def test_sliding_window_suite_over_kv_tiers(check: Check[object]) -> None:
    check(_over_tiers)


@pytest.mark.parametrize("check", HYBRID_KV_CACHE_MANAGER_SUITE.checks, ids=HYBRID_KV_CACHE_MANAGER_SUITE.ids)
@pytest.mark.parametrize("factory", [_over_windowed_tiers, _over_windowed_write_back],
                         ids=["write-through", "write-back"])
def test_sliding_window_suite_over_tiers_keeping_windows(check: Check[object], factory: object) -> None:
    check(factory)


@pytest.mark.parametrize("windows", [False, True], ids=["replayed", "kept"])
def test_the_suite_loads_from_the_tier(windows: bool) -> None:
    """The random check really serves hits from the tier (else it proves nothing of them):
    replaying their windows, or loading them."""
    from deepinfer_kit.cache.tiers.manager import tiered
    from deepinfer_kit.testing.hybrid_cache import _Driver

    layout = KVLayout.from_windows([None, 5, 5, 9], backtrack=3)
    m = _over_tiers(32, 4, layout, 16, 64, windows=windows)  # the random check's small full pool
    driver = _Driver(m, 0, 20)
    for _ in range(150):
        driver.step()
    stats = tiered(m).tier_stats  # type: ignore[union-attr]
    assert stats.loaded_tokens > 0
    if windows:
        assert driver.loaded_windows > 0 and stats.saved_host > 0
    else:
        assert m.window_stats.replays > 0 and driver.loaded_windows == 0


def test_window_stats_price_the_hits_the_windows_cost() -> None:
    """A hit whose window was evicted is shortened; the stats count the tokens lost and what
    a bounded replay (``replay_bound`` tokens at most) would have recomputed instead."""
    from deepinfer_kit.testing.cache_manager_checks import make_request

    layout = KVLayout.from_windows([None, 5, 5, 3])
    assert layout.replay_bound == (4 + 4 + 2) + 5
    assert KVLayout.from_windows([None, None]).replay_bound == 0
    m = _hybrid("radix", 64, 4, layout, 4)
    a = make_request("a", list(range(40)))
    for start in range(0, 40, 4):  # prefilled in chunks: its window moves on, early windows are freed
        m.allocate(a, 4)
        a.num_computed_tokens = start + 4
        m.cache_full_blocks(a, a.num_computed_tokens)
    m.free(a)
    other = make_request("o", [99] * 12)
    m.allocate(other, 12)  # takes the sliding pool: a's idle windows are evicted
    m.free(other)
    b = make_request("b", list(range(40)) + [7])
    hit = m.match_prefix(b)
    w = m.window_stats
    assert (w.queries, w.full_hit_tokens, w.kept_tokens) == (1, 40, hit)
    assert hit < 40 and w.replay_tokens == min(40 - hit, layout.replay_bound) > 0


def test_a_replays_inexact_blocks_are_never_hit() -> None:
    """While a replay's sequence holds the blocks it wrote before its first exact position,
    another request whose hit would end inside them is shortened, not served from them."""
    from deepinfer_kit.testing.cache_manager_checks import make_request

    layout = KVLayout.from_windows([None, 3, 3, 3, 3, 3])
    assert layout.replay_bound == 13
    m = _hybrid("radix", 64, 4, layout, 10, replay_limit=64)
    prefix = list(range(40))
    a = make_request("a", prefix)
    for start in range(0, 40, 4):
        m.allocate(a, 4)
        a.num_computed_tokens = start + 4
        m.cache_full_blocks(a, a.num_computed_tokens)
    m.free(a)
    for _, window_map in m.group_maps():  # memory pressure: a's idle windows are evicted
        window_map.clear_idle()
    b = make_request("b", prefix + [7])
    hit = m.match_prefix(b)
    assert hit == 40 and m.replay_start(b, hit) == 24  # replayed from (40 - 13) // 4 * 4
    m.allocate(b, 1, hit)
    assert m.window_stats.replays == 1
    c = make_request("c", prefix[:33] + [5])  # its full hit (32) ends inside b's inexact blocks
    assert m.match_prefix(c) < 32
    m.free(b)
    m.check_integrity(())
