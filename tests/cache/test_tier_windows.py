"""TieredHybridKVCacheManager: the hybrid cache's plans over KV tiers that keep windows — each
save and load carries every sliding group's block; a save is queued only while the block's
windows are cached, and reads the blocks noted then, so no tier slot ever holds a block
without its windows."""

from __future__ import annotations

import pytest

from deepinfer_kit.cache.free_list_allocator import FreeListBlockAllocator
from deepinfer_kit.cache.layer_groups import KVLayout
from deepinfer_kit.cache.radix_index import RadixPrefixIndex
from deepinfer_kit.cache.tiers.bytes import NoBytes
from deepinfer_kit.cache.tiers.config import TierConfig
from deepinfer_kit.cache.tiers.hybrid import TieredHybridKVCacheManager
from deepinfer_kit.cache.tiers.manager import TieredKVCacheManager
from deepinfer_kit.cache.tiers.offload import OffloadConnector
from deepinfer_kit.cache.tiers.records import TransferOutput
from deepinfer_kit.errors import InvariantError
from deepinfer_kit.testing.cache_manager_checks import make_request

P = 4


def _manager(sliding: int, full: int = 64) -> tuple[TieredHybridKVCacheManager, OffloadConnector]:
    connector = OffloadConnector(TierConfig(host_blocks=64), NoBytes(), None, P)
    inner = TieredKVCacheManager(FreeListBlockAllocator(full, P), RadixPrefixIndex(P), connector)
    layout = KVLayout.from_windows([None, 5])  # replay bound (5 - 1) + 5 = 9
    return TieredHybridKVCacheManager(inner, layout, sliding, replay_limit=64), connector


def _round(m: TieredHybridKVCacheManager, step: int) -> tuple[list[tuple[int, int, int]], object]:
    """What the scheduler does when a plan is built: the mappings, then the transfers."""
    updates = m.drain_table_updates()
    return updates, m.inner.drain_kv_transfers(step)  # type: ignore[attr-defined]


def test_saves_and_loads_carry_each_groups_blocks() -> None:
    m, connector = _manager(sliding=16, full=8)
    r1 = make_request("r1", list(range(16)))
    m.allocate(r1, 16)
    _round(m, 1)
    m.inner.finish_kv_transfers(1, None)  # type: ignore[attr-defined]
    m.cache_full_blocks(r1, 16)  # write-through: four saves queued
    updates, plan = _round(m, 2)
    own = {full: b for g, full, b in m.drain_table_updates()}  # nothing new
    assert not updates and not own
    blocks = [b for b, _ in plan.saves]  # type: ignore[attr-defined]
    assert blocks == r1.block_table
    (maps,) = [mp for _, mp in m.group_maps()]
    assert plan.save_groups == {1: [maps.lookup(b) for b in blocks]}  # type: ignore[attr-defined]
    m.inner.finish_kv_transfers(2, TransferOutput(saved=[s for _, s in plan.saves]))  # type: ignore[attr-defined]
    assert connector.stats.saved_host == 4

    m.free(r1)
    other = make_request("other", [100 + i for i in range(32)])
    m.allocate(other, 32)  # the whole device pool: r1's blocks are evicted (the host tier keeps them)
    m.free(other)
    r2 = make_request("r2", list(range(16)) + [7, 7])
    assert m.match_prefix(r2) == 16  # every block from the tier: their windows come with them
    m.allocate(r2, 2, 16)
    updates, plan = _round(m, 3)
    loads = plan.loads  # type: ignore[attr-defined]
    assert [b for _, b in loads] == r2.block_table[:4]
    mapped = {full: b for _, full, b in updates}
    # the window before token 16 (tokens 12..15 and the next block's) holds blocks 3 and 4 only
    assert plan.load_groups == {1: [-1, -1, -1, mapped[r2.block_table[3]]]}  # type: ignore[attr-defined]
    assert m.window_stats.replays == 0
    m.inner.finish_kv_transfers(3, TransferOutput())  # type: ignore[attr-defined]
    m.free(r2)
    m.check_integrity(())


def test_a_save_reads_the_window_it_was_queued_with() -> None:
    """r1's six saves are queued at publish, while its windows are cached; before the round
    that runs them, another request evicts five of r1's idle windows and a bounded replay
    maps three of those blocks afresh. The saves still read the blocks noted at publish:
    that round's loads and forward write them only after its saves."""
    m, connector = _manager(sliding=8)
    r1 = make_request("r1", list(range(24)))
    m.allocate(r1, 24)
    _round(m, 1)
    m.inner.finish_kv_transfers(1, None)  # type: ignore[attr-defined]
    (maps,) = [mp for _, mp in m.group_maps()]
    noted = [maps.lookup(b) for b in r1.block_table]
    m.cache_full_blocks(r1, 24)
    m.free(r1)  # six idle windows, their saves queued
    r2 = make_request("r2", [100 + i for i in range(28)])
    m.allocate(r2, 28)  # seven sliding blocks: the two free, then five of r1's idle ones
    m.free(r2)  # preempted in the same plan
    r3 = make_request("r3", list(range(24)) + [9, 9, 9, 9])
    assert m.match_prefix(r3) == 24 and m.replay_start(r3, 24) == 12  # a replay from token 12
    m.allocate(r3, 4, 24)
    table = r3.block_table
    assert [maps.lookup(b) is not None for b in table[:6]] == [True, False, False, True, True, True]
    _, plan = _round(m, 2)
    assert [b for b, _ in plan.saves] == table[:6]  # type: ignore[attr-defined]
    assert plan.save_groups == {1: noted}  # type: ignore[attr-defined]
    m.inner.finish_kv_transfers(2, TransferOutput(saved=[s for _, s in plan.saves]))  # type: ignore[attr-defined]
    assert connector.stats.saved_host == 6 and m.refused_saves == 0
    m.free(r3)
    m.check_integrity(())


def test_a_block_whose_window_is_gone_is_never_saved() -> None:
    """The next chunk is planned before the round that computed blocks 0..3 commits (as
    under overlap): the window leaves blocks 0..2, which are kept idle to be published a
    round late; another request's allocation then evicts two of those idle windows. At the
    commit the blocks go into the device index, but only blocks 2 and 3 (their windows
    there) into the tier."""
    m, connector = _manager(sliding=8)
    r1 = make_request("r1", list(range(24)))
    m.allocate(r1, 16)
    _round(m, 1)
    r1.num_computed_tokens = 16
    m.allocate(r1, 8)  # blocks 0..2 leave the window: kept idle, not yet published
    (maps,) = [mp for _, mp in m.group_maps()]
    assert all(maps.lookup(b) is not None for b in r1.block_table)
    r2 = make_request("r2", [100 + i for i in range(16)])
    m.allocate(r2, 16)  # four sliding blocks (five counted): the two free, then two idle ones
    assert [maps.lookup(b) is not None for b in r1.block_table] == [False, False, True, True, True, True]
    m.inner.finish_kv_transfers(1, None)  # type: ignore[attr-defined]
    m.cache_full_blocks(r1, 16)  # round 1 commits
    assert m.refused_saves == 2
    _, plan = _round(m, 2)
    assert [b for b, _ in plan.saves] == r1.block_table[2:4]  # type: ignore[attr-defined]
    m.inner.finish_kv_transfers(2, TransferOutput(saved=[s for _, s in plan.saves]))  # type: ignore[attr-defined]
    assert connector.stats.saved_host == 2
    m.free(r1)
    m.free(r2)
    m.check_integrity(())


def test_a_load_into_a_window_some_sequence_reads_is_refused() -> None:
    m, _ = _manager(sliding=8)
    with pytest.raises(InvariantError, match="holds a window from an earlier round"):
        m._load_target(1, 3, fresh=False)  # noqa: SLF001
    assert m._load_target(1, None, fresh=False) == -1  # noqa: SLF001


@pytest.mark.parametrize("savable", [False, True])
def test_a_block_not_savable_is_still_a_use_of_its_tier_copy(savable: bool) -> None:
    """A block published without its window (loaded from a tier outside every window) whose
    key the host tier holds counts as a use there, so LRU keeps it over an older key; a
    block not savable whose key the tier lacks is not saved."""
    connector = OffloadConnector(TierConfig(host_blocks=2), NoBytes(), None, P)
    r = make_request("r", list(range(8)))
    connector.on_published(r, 0, [b"A", b"B"], [1, 2])
    plan = connector.build_transfers(1)
    connector.update_from_output(1, TransferOutput(saved=[s for _, s in plan.saves]))
    connector.on_published(r, 0, [b"A", b"D"], [3, 4], [savable, False])
    connector.on_published(r, 0, [b"C"], [5])  # takes the least recently used slot
    held = {k for s in range(2) if (k := connector.host.key(s)) is not None}
    assert held == {b"A", b"C"}
