"""A bounded replay's windows are readable by other requests only once its round committed:
a round that fails (its request freed without publishing past the hit) leaves blocks mapped
but never written, and a later hit must not read them."""

from __future__ import annotations

import pytest

from deepinfer_kit.cache import BlockKVCacheManager, FreeListBlockAllocator, RadixPrefixIndex
from deepinfer_kit.cache.hybrid_manager import HybridKVCacheManager
from deepinfer_kit.cache.layer_groups import KVLayout
from deepinfer_kit.testing.cache_manager_checks import make_request

P = 4


@pytest.mark.parametrize("committed", [True, False], ids=["committed", "failed"])
def test_a_replay_windows_wait_for_its_commit(committed: bool) -> None:
    m = HybridKVCacheManager(BlockKVCacheManager(FreeListBlockAllocator(64, P), RadixPrefixIndex(P)),
                             KVLayout.from_windows([None, 5]), 8, replay_limit=64)  # replay bound 9
    r1 = make_request("r1", list(range(24)))
    m.allocate(r1, 24)
    m.cache_full_blocks(r1, 24)
    m.free(r1)  # six idle windows
    r2 = make_request("r2", [100 + i for i in range(28)])
    m.allocate(r2, 28)  # evicts five of them
    m.free(r2)
    r3 = make_request("r3", list(range(24)) + [9, 9, 9, 9])
    assert m.match_prefix(r3) == 24 and m.replay_start(r3, 24) == 12
    m.allocate(r3, 4, 24)  # the replay's round: tokens 12..27
    r3.num_computed_tokens = 28
    if committed:
        m.cache_full_blocks(r3, 28)
    m.free(r3)  # finished, or ended with an error by a failed round
    r4 = make_request("r4", list(range(24)) + [5, 5, 5, 5])
    hit = m.match_prefix(r4)
    assert hit == 24
    # committed: the replay's exact windows (blocks 4 and 5) are idle and cached, the hit
    # is kept whole; failed: they were never written, so the hit needs a replay again
    assert m.replay_start(r4, hit) == (24 if committed else 12)
    m.free(r4)
    m.check_integrity(())
