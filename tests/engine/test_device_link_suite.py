"""The KV connector suite over the device link's two halves in one process (sends into
landing slots the same pool loads from), the suite catching broken ones, and the landing
slots' own rules."""

from __future__ import annotations

import threading
from typing import Any
import time

import pytest
import torch

from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.cache.tiers.records import TransferOutput, TransferPlan
from deepinfer_kit.disagg.landing import LandingSlots
from deepinfer_kit.disagg.link_connector import DeviceLinkConnector
from deepinfer_kit.disagg.link_sender import LoopbackSender
from deepinfer_kit.disagg.link_worker import DeviceSlotWorker
from deepinfer_kit.errors import InvariantError
from deepinfer_kit.testing.kv_connector import KV_CONNECTOR_SUITE
from deepinfer_kit.testing.suite import Check, ConformanceError


def _loopback(kv: PagedKVCache, folder: str, worker: type[DeviceSlotWorker] = DeviceSlotWorker,
              connector: type[DeviceLinkConnector] = DeviceLinkConnector) -> tuple[DeviceLinkConnector, DeviceSlotWorker]:
    landing = LandingSlots(kv, 64, b"f" * 16)
    send = torch.zeros((16, *kv.block_shape), dtype=kv.dtype)
    return (connector(kv.block_size, b"k" * 32, sender=LoopbackSender(landing), send_slots=send, landing=landing,
                      send_all=True), worker(kv, send, landing.slab))


@pytest.mark.parametrize("check", KV_CONNECTOR_SUITE.checks, ids=KV_CONNECTOR_SUITE.ids)
def test_the_device_link_keeps_the_connector_contract(check: Check[object]) -> None:
    check(_loopback)


class _LoadsNextSlot(DeviceSlotWorker):
    def start_load_kv(self, plan: TransferPlan) -> None:
        n = self._landing.shape[0] if self._landing is not None else 1
        super().start_load_kv(TransferPlan([], [((s + 1) % n, b) for s, b in plan.loads]))


class _SavesNothing(DeviceSlotWorker):
    def start_save_kv(self, plan: TransferPlan) -> None:
        self._asked = True
        self._saved.extend(s for _, s in plan.saves)


@pytest.mark.parametrize("broken", [_LoadsNextSlot, _SavesNothing])
def test_the_suite_catches_a_link_moving_the_wrong_bytes(broken: type[DeviceSlotWorker]) -> None:
    with pytest.raises(ConformanceError, match="another prefix"):
        KV_CONNECTOR_SUITE.checks[0](lambda kv, folder: _loopback(kv, folder, worker=broken))


def test_the_suite_catches_a_link_that_never_releases_a_round_s_landing_slots() -> None:
    class Keeps(DeviceLinkConnector):
        def update_from_output(self, step_id: int, output: object) -> None:
            self._round_pins.pop(step_id, None)  # forgotten, never unpinned
            super().update_from_output(step_id, output)  # type: ignore[arg-type]

    with pytest.raises(Exception, match="idle check|pinned"):
        KV_CONNECTOR_SUITE.checks[0](lambda kv, folder: _loopback(kv, folder, connector=Keeps))


def _landing(n: int = 2) -> tuple[LandingSlots, PagedKVCache]:
    kv = PagedKVCache(2, 4, 4, 1, 4, impl="ref")
    return LandingSlots(kv, n, b"f" * 16), kv


def test_landing_slots_take_the_least_recent_unpinned_block_and_drop_when_all_are_pinned() -> None:
    landing, kv = _landing()
    block = torch.ones(kv.block_shape)
    landing.put(b"a", block)
    landing.put(b"b", 2 * block)
    landing.put(b"a", 9 * block)  # kept once: the first bytes stay
    assert torch.equal(landing.slab[landing.pin([b"a"])[0]], block)
    landing.put(b"c", 3 * block)  # "b" is the least recent unpinned one
    assert landing.ready([b"b"]) == 0 and landing.ready([b"a", b"c"]) == 2 and landing.evicted == 1
    landing.pin([b"c"])
    landing.put(b"d", block)
    assert landing.dropped == 1 and landing.ready([b"d"]) == 0
    with pytest.raises(InvariantError, match="pinned"):
        landing.check_idle()
    with pytest.raises(InvariantError, match="not here"):
        landing.pin([b"d"])
    with pytest.raises(InvariantError, match="bytes"):
        landing.put(b"e", torch.ones(3))


def test_a_waiting_reader_wakes_when_its_block_lands() -> None:
    landing, kv = _landing()
    got: list[int] = []
    reader = threading.Thread(target=lambda: got.append(landing.ready([b"x"], 1, time.monotonic() + 60)))
    reader.start()
    landing.put(b"x", torch.ones(kv.block_shape))
    reader.join(30)
    assert got == [1]
    assert landing.ready([b"y"], 1, 0.0) == 0  # a deadline passed: no wait


def test_a_message_of_several_blocks_lands_in_one_copy_keeping_each_key_once() -> None:
    landing, kv = _landing(3)
    block = torch.ones(kv.block_shape)
    landing.put(b"a", block)
    rows = torch.stack([2 * block, 3 * block, 4 * block, 5 * block]).view(torch.uint8).reshape(4, -1)
    landing.pin([b"a"])
    landing.put_many([b"a", b"b", b"b", b"c"], rows)  # "a" is here, "b" twice: the first kept
    assert landing.received == 3 and landing.ready([b"a", b"b", b"c"]) == 3
    slots = landing.pin([b"a", b"b", b"c"])
    assert [float(landing.slab[s].flatten()[0]) for s in slots] == [1.0, 3.0, 5.0]
    landing.put_many([b"d"], rows[:1])  # every slot pinned: dropped
    assert landing.dropped == 1 and landing.ready([b"d"]) == 0
    with pytest.raises(InvariantError, match="bytes"):
        landing.put_many([b"e", b"f"], rows[:2, :8])


def test_a_block_that_cannot_be_sent_again_is_no_longer_told_of() -> None:
    from deepinfer_kit.request import Request

    kv = PagedKVCache(2, 8, 4, 1, 4, impl="ref")
    connector, _ = _loopback(kv, "")
    req = Request("r", list(range(13)), kv_params=None)
    keys = [b"k0", b"k1", b"k2"]
    connector.on_published(req, 0, keys, [0, 1, 2])
    for (_, slot), key in zip(connector.build_transfers(1).saves, keys):
        assert connector.sends._saving[slot] == key  # noqa: SLF001
    connector.update_from_output(1, TransferOutput(saved=[s for s, _ in connector.sends._saving.items()]))  # noqa: SLF001
    assert connector.keys_down(keys) == 3
    connector.on_device_hit(req, keys[:2], [0, 1], [True, False])  # block 1's window is gone
    assert connector.keys_down(keys) == 1 and connector.stats.saved_host == 3


def test_a_block_refused_a_send_slot_is_no_longer_told_of() -> None:
    from deepinfer_kit.request import Request

    kv = PagedKVCache(2, 8, 4, 1, 4, impl="ref")
    landing = LandingSlots(kv, 4, b"f" * 16)
    connector = DeviceLinkConnector(4, b"k" * 32, sender=LoopbackSender(landing), landing=landing,
                                    send_slots=torch.zeros((1, *kv.block_shape)), send_all=True)
    req = Request("r", list(range(13)), kv_params=None)
    connector.on_published(req, 0, [b"k0"], [0])
    connector.update_from_output(1, TransferOutput(saved=[s for _, s in connector.build_transfers(1).saves]))
    assert connector.keys_down([b"k0"]) == 1
    connector.on_published(req, 1, [b"k1"], [1])  # takes the one send slot
    connector.on_device_hit(req, [b"k0"], [0])  # k0 again, no slot free: refused
    assert connector.stats.refused == 1 and connector.keys_down([b"k0"]) == 0


def test_blocks_are_counted_and_pinned_at_once_so_a_block_landing_in_between_cannot_take_them() -> None:
    from deepinfer_kit.request import Request

    class Busy(LandingSlots):
        """Another block lands right after every count the lock does not cover: it takes
        the least recent unpinned slot."""

        def ready(self, keys: Any, wait_for: int = 0, deadline: float | None = None) -> int:
            n = super().ready(keys, wait_for, deadline)
            self.put(b"late%d" % self.received, torch.zeros(self.slab.shape[1:]))
            return n

    kv = PagedKVCache(2, 8, 4, 1, 4, impl="ref")
    landing = Busy(kv, 2, b"f" * 16)
    landing.put(b"k0", torch.ones(kv.block_shape))
    landing.put(b"k1", torch.ones(kv.block_shape))  # full: the next block takes "k0"'s slot
    connector = DeviceLinkConnector(4, b"k" * 32, landing=landing)
    req = Request("r", list(range(13)), kv_params=None)
    assert connector.get_num_new_matched_tokens(req, [b"k0", b"k1"], 0) == 2
    connector.request_finished(req)
    landing.check_idle()
