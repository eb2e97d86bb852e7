"""The LRU policy passes both eviction-policy suites; the suites catch broken policies."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from deepinfer_kit.cache import LRUEvictionPolicy
from deepinfer_kit.testing.eviction import EVICTION_POLICY_SUITE, LRU_POLICY_SUITE, LRUModel
from deepinfer_kit.testing.suite import Check, ConformanceError


@pytest.mark.parametrize("check", EVICTION_POLICY_SUITE.checks, ids=EVICTION_POLICY_SUITE.ids)
def test_lru_policy_keeps_the_contract(check: Check[object]) -> None:
    check(LRUEvictionPolicy)


@pytest.mark.parametrize("check", LRU_POLICY_SUITE.checks, ids=LRU_POLICY_SUITE.ids)
def test_lru_policy_keeps_lru_order(check: Check[object]) -> None:
    check(LRUEvictionPolicy)


@pytest.mark.parametrize("check", EVICTION_POLICY_SUITE.checks + LRU_POLICY_SUITE.checks,
                         ids=EVICTION_POLICY_SUITE.ids + LRU_POLICY_SUITE.ids)
def test_the_list_model_passes_its_own_suites(check: Check[object]) -> None:
    check(LRUModel)


class _ForgetsTouchedDiscards(LRUEvictionPolicy):
    """Cancels an owed touch on any discard, even of other blocks (a plausible bug)."""

    __slots__ = ()

    def discard(self, blocks: Sequence[int]) -> None:
        self._owed = None
        super().discard(blocks)


class _FifoPolicy(LRUModel):
    """Ignores touches: first in, first out."""

    def touch(self, blocks: Sequence[int]) -> None:
        pass


@pytest.mark.parametrize("broken", [_ForgetsTouchedDiscards, _FifoPolicy])
def test_the_lru_suite_catches_a_wrong_order(broken: type) -> None:
    failed = 0
    for check in LRU_POLICY_SUITE:
        try:
            check(broken)
        except ConformanceError:
            failed += 1
    assert failed >= 1


def test_stale_entries_are_compacted_so_memory_follows_tracked_blocks() -> None:
    p = LRUEvictionPolicy()
    p.push(list(range(100)))
    for i in range(5000):  # touches and discards without pops leave stale entries
        p.touch([i % 100, (i + 1) % 100])
        p.discard([(i + 50) % 100])
        p.push([(i + 50) % 100])
    assert len(p) == 100
    assert p._entries <= 2 * len(p) + 256 + 12
    assert sorted(p.pop(200)) == list(range(100))


def test_pushing_a_tracked_block_again_moves_it_and_counts_it_once() -> None:
    p = LRUEvictionPolicy()
    p.push([1, 2, 3])
    p.push([2, 4, 4])  # outside the contract (tracked, and twice): still counted once
    assert len(p) == 4
    assert p.pop(4) == [1, 3, 2, 4]
