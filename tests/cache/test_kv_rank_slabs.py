"""The host tier's bytes across ranks: RankSlabs sees whole blocks over per-rank head
shards (split, replicated, single), shared-memory slabs are one memory in two mappings,
and the ranks' transfer reports merge conservatively."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.cache.tiers.records import TransferOutput, merge_outputs
from deepinfer_kit.cache.tiers.shared_slab import SlabShard, map_host_slab, shared_host_slab
from deepinfer_kit.cache.tiers.slab_bytes import RankSlabs
from deepinfer_kit.errors import CapacityError, ConfigError

_BLOCK = (2, 2, 4, 4, 3)  # [L, planes, P, Hkv, D]


def _full(seed: int) -> torch.Tensor:
    return torch.randn(_BLOCK, generator=torch.Generator().manual_seed(seed))


def _shards(starts_sizes: list[tuple[int, int]], slots: int = 3) -> list[torch.Tensor]:
    return [torch.zeros((slots, 2, 2, 4, n, 3)) for _, n in starts_sizes]


@pytest.mark.parametrize("layout", [
    [(0, 4)],  # one rank
    [(0, 2), (2, 2)],  # tensor-parallel halves
    [(0, 1), (1, 1), (2, 1), (3, 1)],
    [(0, 4), (0, 4)],  # expert-parallel copies
    [(2, 2), (0, 2), (2, 2), (0, 2)],  # TP x EP, out of order
], ids=["single", "tp2", "tp4", "ep2", "tp2xep2"])
def test_whole_blocks_round_trip_through_any_split(layout: list[tuple[int, int]]) -> None:
    slabs = _shards(layout)
    view = RankSlabs(slabs, [s for s, _ in layout], 4)
    assert view.block_shape == _BLOCK
    block = _full(1)
    view.write(2, block)
    for slab, (start, n) in zip(slabs, layout):  # every rank holds exactly its heads
        assert torch.equal(slab[2], block[:, :, :, start:start + n])
        assert not slab[:2].any()
    assert torch.equal(view.read(2), block)
    got = view.read(2)
    got.zero_()  # a read is a copy the caller may keep
    assert torch.equal(view.read(2), block)


def test_a_block_written_under_one_split_reads_the_same_under_another() -> None:
    two = RankSlabs(_shards([(0, 2), (2, 2)]), [0, 2], 4)
    one = RankSlabs(_shards([(0, 4)]), [0], 4)
    block = _full(2)
    two.write(0, block)
    one.write(1, two.read(0))
    assert torch.equal(one.slabs[0][1], block)


def test_replicated_heads_fewer_than_ranks() -> None:
    # Hkv = 2 over 4 ranks: ranks 0, 1 hold head 0; ranks 2, 3 head 1 (attention_shard).
    layout = [(0, 1), (0, 1), (1, 1), (1, 1)]
    slabs = [torch.zeros((1, 2, 2, 4, 1, 3)) for _ in layout]
    view = RankSlabs(slabs, [s for s, _ in layout], 2)
    block = torch.randn((2, 2, 4, 2, 3))
    view.write(0, block)
    assert torch.equal(view.read(0), block)
    assert torch.equal(slabs[1][0], block[:, :, :, 0:1])


@pytest.mark.parametrize("starts, total, message", [
    ([0, 1], 4, "do not tile"),  # overlapping ranges
    ([0, 3], 4, "do not tile"),  # a gap
    ([0, 2], 5, "do not tile"),  # short of the total
])
def test_head_ranges_that_do_not_tile_are_refused(starts: list[int], total: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RankSlabs(_shards([(0, 2), (0, 2)]), starts, total)


def test_slabs_of_other_shapes_are_refused() -> None:
    with pytest.raises(ConfigError, match="rank 1's host slab"):
        RankSlabs([torch.zeros((3, 2, 2, 4, 2, 3)), torch.zeros((3, 2, 2, 8, 2, 3))], [0, 2], 4)
    with pytest.raises(ConfigError, match="rank 1's host slab"):
        RankSlabs([torch.zeros((3, 2, 2, 4, 2, 3)), torch.zeros((3, 2, 2, 4, 2, 3), dtype=torch.float16)], [0, 2], 4)


def test_a_shared_slab_is_one_memory_in_two_processes(tmp_path: object) -> None:
    kv = PagedKVCache(2, 4, 4, 2, 3)
    slab, fd, shard = shared_host_slab(kv, 5, 0, 2)
    assert slab.shape == (5, *kv.block_shape) and not slab.any()
    mine = map_host_slab(fd, shard)
    slab[3].fill_(2.5)
    assert torch.equal(mine[3], slab[3])  # the host's mapping sees the worker's copies
    # Another process maps it by the descriptor it inherits and writes a slot.
    code = ("import sys, torch; from deepinfer_kit.cache.tiers.shared_slab import SlabShard, map_host_slab; "
            f"s = map_host_slab({fd}, SlabShard({shard.shape!r}, {shard.dtype!r}, 0, 2)); s[1].fill_(7.0)")
    subprocess.run([sys.executable, "-c", code], check=True, pass_fds=(fd,),
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
    assert bool((slab[1] == 7.0).all())
    os.close(fd)


def test_a_shared_slab_too_big_is_a_capacity_error() -> None:
    kv = PagedKVCache(2, 4, 4, 2, 3)
    with pytest.raises(CapacityError, match="host_blocks=1000000000000"):
        shared_host_slab(kv, 10**12, 0, 2)


def test_a_shard_names_its_dtype() -> None:
    assert SlabShard((1, 2), "torch.bfloat16", 0, 1).torch_dtype is torch.bfloat16
    with pytest.raises(ConfigError, match="'torch.nope'"):
        SlabShard((1, 2), "torch.nope", 0, 1).torch_dtype


def test_rank_reports_merge_conservatively() -> None:
    a = TransferOutput(saved=[1, 2, 3], failed_saves=[], failed_loads=[])
    b = TransferOutput(saved=[1, 3], failed_saves=[2], failed_loads=[9])
    merged = merge_outputs([a, b])
    assert merged is not None
    assert merged.saved == [1, 3] and merged.failed_saves == [2] and merged.failed_loads == [9]
    missing = merge_outputs([a, TransferOutput(saved=[1, 2])])  # rank 1 never reported slot 3
    assert missing is not None and missing.saved == [1, 2] and missing.failed_saves == [3]
    silent = merge_outputs([a, None])  # a rank that reported nothing saved nothing
    assert silent is not None and silent.saved == [] and silent.failed_saves == [1, 2, 3]
    assert merge_outputs([None, None]) is None
    assert merge_outputs([a]) is a
