"""The tiers' parts alone: checksummed block files, the frequency eviction policy, slot
accounting, admission."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer_kit.cache.frequency_policy import FrequencyEvictionPolicy
from deepinfer_kit.cache.lru_policy import LRUEvictionPolicy
from deepinfer_kit.cache.tiers.admission import SeenTwice
from deepinfer_kit.cache.tiers.disk_store import DiskBlockStore, layout_fingerprint
from deepinfer_kit.cache.tiers.slots import TierSlots
from deepinfer_kit.errors import ConfigError, InvariantError
from deepinfer_kit.testing.eviction import EVICTION_POLICY_SUITE
from deepinfer_kit.testing.suite import Check

_FP = layout_fingerprint("m", (2, 2, 4, 1, 4), "torch.float32")


def _block(seed: int) -> torch.Tensor:
    return torch.arange(64, dtype=torch.float32).view(2, 2, 4, 1, 4) + seed


def test_a_block_file_reads_back_exactly(tmp_path: Path) -> None:
    store = DiskBlockStore(tmp_path, _FP)
    store.put(b"k1", _block(3))
    out = torch.empty(2, 2, 4, 1, 4)
    assert store.get_into(b"k1", out) and torch.equal(out, _block(3))
    assert not store.get_into(b"k2", out)  # missing
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("damage", ["flip", "truncate", "pad", "empty", "other_key"])
def test_a_damaged_file_reads_as_a_miss_and_is_deleted(tmp_path: Path, damage: str) -> None:
    store = DiskBlockStore(tmp_path, _FP)
    store.put(b"k1", _block(1))
    path = store.path(b"k1")
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-1] ^= 1
    elif damage == "truncate":
        data = data[:-7]
    elif damage == "pad":
        data += b"x"
    elif damage == "empty":
        data = bytearray()
    else:
        store.put(b"k2", _block(1))
        data = bytearray(store.path(b"k2").read_bytes())
    path.write_bytes(bytes(data))
    assert not store.get_into(b"k1", torch.empty(2, 2, 4, 1, 4))
    assert not path.exists()


def test_another_layouts_file_is_a_miss_left_alone(tmp_path: Path) -> None:
    DiskBlockStore(tmp_path, layout_fingerprint("other")).put(b"k1", _block(1))
    store = DiskBlockStore(tmp_path, _FP)
    assert not store.get_into(b"k1", torch.empty(2, 2, 4, 1, 4))
    assert store.path(b"k1").exists()


def test_store_refuses_a_bad_fingerprint(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="fingerprint"):
        DiskBlockStore(tmp_path, b"short")


@pytest.mark.parametrize("check", EVICTION_POLICY_SUITE.checks, ids=EVICTION_POLICY_SUITE.ids)
def test_frequency_policy_keeps_the_eviction_contract(check: Check[object]) -> None:
    check(FrequencyEvictionPolicy)


def test_frequency_policy_keeps_the_hot_block_through_a_burst() -> None:
    freq, lru = FrequencyEvictionPolicy(), LRUEvictionPolicy()
    for p in (freq, lru):
        p.push([0])
        for _ in range(5):
            p.touch([0])  # a hot system prompt
        p.push(list(range(1, 9)))  # a burst of one-off blocks, all newer
    assert freq.pop(8) == list(range(1, 9))
    assert lru.pop(1) == [0]


def test_frequency_policy_ages_counts() -> None:
    p = FrequencyEvictionPolicy(period=4)
    p.push([0, 1])
    p.touch([0, 0])  # uses reach the period: counts halve (0: 3 -> 1, 1: 1 -> 0)
    assert p.count(0) == 1 and p.count(1) == 0
    assert p.pop(2) == [1, 0]


def test_slots_account_pins_and_eviction() -> None:
    slots = TierSlots(2, LRUEvictionPolicy())
    a, _ = slots.take(b"a")  # type: ignore[misc]
    b, _ = slots.take(b"b")  # type: ignore[misc]
    assert slots.take(b"c") is None  # both pending
    slots.mark_ready(a)
    slots.mark_ready(b)
    slots.pin(a)
    assert slots.take(b"c") == (b, b"b")  # the pinned one stays
    assert slots.slot(b"b") is None and slots.slot(b"c") == b
    slots.drop(a)  # dropped while pinned: freed when unpinned
    slots.check()
    slots.unpin(a)
    slots.check()
    with pytest.raises(InvariantError):
        slots.unpin(a)
    with pytest.raises(InvariantError):
        slots.take(b"c")


def test_seen_twice_admits_the_second_sighting() -> None:
    adm = SeenTwice(window=2)
    assert not adm.admit(b"a")
    assert adm.admit(b"a")
    adm.observe([b"b", b"c"])  # pushes "a" out of the window
    assert not adm.admit(b"a")
    assert adm.admit(b"c")
