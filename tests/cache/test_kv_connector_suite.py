"""The KV connector suite over the built-in tiers (host only; host + disk, both write
policies, frequency eviction, seen-twice admission), and the suite catching broken ones."""

from __future__ import annotations

import pytest

from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.cache.tiers.build import build_tiers
from deepinfer_kit.cache.tiers.config import TierConfig
from deepinfer_kit.cache.tiers.host_worker import HostTransferWorker
from deepinfer_kit.cache.tiers.slab_bytes import RankSlabs
from deepinfer_kit.cache.tiers.offload import OffloadConnector
from deepinfer_kit.cache.tiers.records import TransferPlan
from deepinfer_kit.testing.kv_connector import KV_CONNECTOR_SUITE
from deepinfer_kit.testing.suite import Check, ConformanceError

_CONFIGS = {
    "host": dict(host_blocks=20),
    "host_disk_through": dict(host_blocks=8, disk_blocks=200),
    "host_disk_back": dict(host_blocks=8, disk_blocks=200, write_policy="write_back"),
    "frequency_seen_twice": dict(host_blocks=8, disk_blocks=200, host_eviction="frequency",
                                 disk_eviction="frequency", admission="seen_twice"),
}


def _factory(fields: dict[str, object]):  # type: ignore[no-untyped-def]
    def make(kv: PagedKVCache, folder: str) -> tuple[OffloadConnector, HostTransferWorker]:
        extra = {"disk_path": folder} if fields.get("disk_blocks") else {}
        return build_tiers(TierConfig(**fields, **extra), kv)  # type: ignore[arg-type]
    return make


@pytest.mark.parametrize("name", sorted(_CONFIGS))
@pytest.mark.parametrize("check", KV_CONNECTOR_SUITE.checks, ids=KV_CONNECTOR_SUITE.ids)
def test_builtin_tiers_keep_the_contract(check: Check[object], name: str) -> None:
    check(_factory(_CONFIGS[name]))


class _LoadsWrongSlot(HostTransferWorker):
    """Loads each block from the next slot over: the suite must see wrong K/V."""

    def start_load_kv(self, plan: TransferPlan) -> None:
        n = self._slab.shape[0]
        super().start_load_kv(TransferPlan([], [((s + 1) % n, b) for s, b in plan.loads]))


class _NeverSaves(HostTransferWorker):
    """Reports saves done without copying anything."""

    def start_save_kv(self, plan: TransferPlan) -> None:
        self._asked = True
        self._saved.extend(s for _, s in plan.saves)


@pytest.mark.parametrize("broken", [_LoadsWrongSlot, _NeverSaves])
def test_the_suite_catches_wrong_bytes(broken: type[HostTransferWorker]) -> None:
    def make(kv: PagedKVCache, folder: str) -> tuple[OffloadConnector, HostTransferWorker]:
        connector, worker = build_tiers(TierConfig(host_blocks=20), kv)
        return connector, broken(kv, worker._slab)
    with pytest.raises(ConformanceError, match="another prefix"):
        KV_CONNECTOR_SUITE.checks[0](make)


def test_the_suite_catches_a_connector_that_leaks_pins() -> None:
    class Leaky(OffloadConnector):
        def build_transfers(self, step_id: int) -> TransferPlan:
            pins = list(self._load_pins)
            plan = super().build_transfers(step_id)
            for s in pins:  # never released
                self.host.pin(s)
            return plan

    def make(kv: PagedKVCache, folder: str) -> tuple[OffloadConnector, HostTransferWorker]:
        connector, worker = build_tiers(TierConfig(host_blocks=20), kv)
        return Leaky(TierConfig(host_blocks=20), RankSlabs([worker._slab], [0], kv.num_kv_heads), None, kv.block_size), worker
    with pytest.raises(Exception, match="idle check"):
        KV_CONNECTOR_SUITE.checks[0](make)
