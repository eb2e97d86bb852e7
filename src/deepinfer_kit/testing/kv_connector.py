"""Conformance suite of the KV connector (``KV_CONNECTOR_SUITE``): both sides of a
connector, driven through the engine's tiered cache manager over a real (small) device
pool with a model of the device that writes each computed block's K/V as a function of
its token prefix — so any block loaded from a tier can be checked byte for byte.

The factory: ``factory(kv_cache, folder) -> (scheduler_side, device_side)``: a
:class:`KVConnectorScheduler` and a :class:`KVConnectorWorker` over ``kv_cache`` (a
:class:`PagedKVCache`), free to keep files under ``folder``; tiers small enough that the
workload's prefixes are evicted from the device and from each other.
"""

from __future__ import annotations

import hashlib
import random
import tempfile
from collections.abc import Callable, Sequence

import torch

from deepinfer_kit.cache.free_list_allocator import FreeListBlockAllocator
from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.cache.radix_index import RadixPrefixIndex
from deepinfer_kit.cache.tiers.manager import TieredKVCacheManager
from deepinfer_kit.cache.tiers.protocols import KVConnectorScheduler, KVConnectorWorker
from deepinfer_kit.cache.tiers.records import TransferOutput, TransferPlan
from deepinfer_kit.request import Request
from deepinfer_kit.testing.suite import Suite, expect

__all__ = ["KV_CONNECTOR_SUITE", "ConnectorFactory", "TierDeviceModel", "FlakyWorker"]

ConnectorFactory = Callable[[PagedKVCache, str], tuple[KVConnectorScheduler, KVConnectorWorker]]

KV_CONNECTOR_SUITE: Suite[ConnectorFactory] = Suite(
    "kv_connector", "factory(kv_cache, folder) -> (KVConnectorScheduler, KVConnectorWorker)")

_P, _L, _H, _D = 4, 2, 1, 4


def _content(prefix: Sequence[int]) -> torch.Tensor:
    """The K/V a block holding the end of ``prefix`` has, ``[L, 2, P, H, D]``: a function
    of the whole prefix, as a model's would be."""
    digest = hashlib.blake2b(repr(tuple(prefix)).encode(), digest_size=32).digest()
    base = torch.tensor(list(digest), dtype=torch.float32)
    n = _L * 2 * _P * _H * _D
    return base.repeat(n // len(base) + 1)[:n].view(_L, 2, _P, _H, _D)


class FlakyWorker:
    """A device side that fails every ``fail_every``-th save (not written, reported in
    ``failed_saves``) and, with ``fail_loads``, every load (not written, reported in
    ``failed_loads``): the injected faults of the suite."""

    def __init__(self, inner: KVConnectorWorker, *, fail_every: int = 0, fail_loads: bool = False) -> None:
        self.inner = inner
        self.fail_every = fail_every
        self.fail_loads = fail_loads
        self._n = 0
        self._failed_saves: list[int] = []
        self._failed_loads: list[int] = []

    def start_save_kv(self, plan: TransferPlan) -> None:
        keep = []
        for pair in plan.saves:
            self._n += 1
            if self.fail_every and self._n % self.fail_every == 0:
                self._failed_saves.append(pair[1])
            else:
                keep.append(pair)
        self.inner.start_save_kv(TransferPlan(keep, []))

    def start_load_kv(self, plan: TransferPlan) -> None:
        if self.fail_loads:
            self._failed_loads.extend(b for _, b in plan.loads)
        else:
            self.inner.start_load_kv(TransferPlan([], plan.loads))

    def wait_for_load(self) -> None:
        self.inner.wait_for_load()

    def get_finished(self) -> TransferOutput | None:
        out = self.inner.get_finished() or TransferOutput()
        out.failed_saves.extend(self._failed_saves)
        out.failed_loads.extend(self._failed_loads)
        self._failed_saves, self._failed_loads = [], []
        return out


class TierDeviceModel:
    """Drives a :class:`TieredKVCacheManager` as the engine does, one request per round:
    match, allocate, drain the round's transfers, run them (saves, then loads), compute
    the blocks not loaded (write their content), report, publish, free. Checks every
    loaded block against the content of its prefix, as the forward would read it: a
    worker with ``wait_for_layer_load`` has each layer read right after its wait."""

    def __init__(self, factory: ConnectorFactory, folder: str, *, num_blocks: int = 24,
                 wrap: Callable[[KVConnectorWorker], KVConnectorWorker] | None = None) -> None:
        self.kv = PagedKVCache(_L, num_blocks, _P, _H, _D, impl="ref")
        connector, worker = factory(self.kv, folder)
        self.worker = wrap(worker) if wrap is not None else worker
        self.manager = TieredKVCacheManager(FreeListBlockAllocator(num_blocks, _P), RadixPrefixIndex(_P),
                                            connector)
        self.loaded = 0
        self.bad_loads: list[int] = []
        self._n = 0

    def serve(self, tokens: list[int]) -> int:
        """One request over ``tokens`` (prefill only); returns the tokens it took from
        any cache."""
        self._n += 1
        m = self.manager
        req = Request(f"r{self._n}", list(tokens))
        m.on_arrival(req)
        cached = m.match_prefix(req)
        device_hit = len(req.prefix_state.hits) * _P if req.prefix_state is not None else 0  # type: ignore[attr-defined]
        m.allocate(req, len(tokens) - cached, cached)
        plan = m.drain_kv_transfers(self._n)
        loaded_blocks = range(device_hit // _P, cached // _P)
        self.worker.start_save_kv(plan)
        self.worker.start_load_kv(plan)
        seen = self._read_loads([req.block_table[i] for i in loaded_blocks], bool(plan.loads))
        report = self.worker.get_finished()
        failed = set(report.failed_loads) if report is not None else set()
        for i, got in zip(loaded_blocks, seen):
            block = req.block_table[i]
            if block not in failed and not torch.equal(got, _content(tokens[:(i + 1) * _P])):
                self.bad_loads.append(block)
        self.loaded += len(loaded_blocks)
        for i in range(cached // _P, len(tokens) // _P):  # the forward writes what it computes
            self.kv._kv[:, :, req.block_table[i]] = _content(tokens[:(i + 1) * _P])  # noqa: SLF001
        m.finish_kv_transfers(self._n, report)
        if not failed.intersection(req.block_table):
            req.num_computed_tokens = len(tokens)
            m.cache_full_blocks(req, len(tokens))
        m.free(req)
        return cached

    def _read_loads(self, blocks: list[int], loading: bool) -> list[torch.Tensor]:
        """What a forward reads of ``blocks`` (each ``[L, 2, P, H, D]``), as the runner
        orders it: with the worker's ``wait_for_layer_load`` (a round with loads), each
        layer read right after its wait, then :meth:`wait_for_load`; else after
        :meth:`wait_for_load`."""
        layered = getattr(self.worker, "wait_for_layer_load", None)
        pool = self.kv._kv  # noqa: SLF001 - the suite reads the pool as the model would
        if layered is None or not loading:
            self.worker.wait_for_load()
            return [pool[:, :, b].clone() for b in blocks]
        layers = []
        for layer in range(_L):
            layered(layer)
            layers.append(pool[layer, :, blocks].clone())  # [2, n, P, H, D]
        self.worker.wait_for_load()
        return list(torch.stack(layers).permute(2, 0, 1, 3, 4, 5)) if blocks else []

    def finish(self) -> None:
        """Push the last saves down, then the idle check."""
        self.manager.transfer_idle(self.worker)
        self.manager.check_integrity(())


def _workload(seed: int, n: int = 80) -> list[list[int]]:
    """Conversations over 6 shared prefixes whose working set is several device pools."""
    rng = random.Random(seed)
    heads = [[rng.randrange(1000) for _ in range(_P * 5)] for _ in range(6)]
    return [heads[rng.randrange(6)] + [rng.randrange(1000) for _ in range(rng.randrange(1, 3 * _P))]
            for _ in range(n)]


def _run(factory: ConnectorFactory, **kw: object) -> TierDeviceModel:
    with tempfile.TemporaryDirectory() as folder:
        model = TierDeviceModel(factory, folder, **kw)  # type: ignore[arg-type]
        for tokens in _workload(0):
            model.serve(tokens)
        model.finish()
        model.manager.close()
        return model


@KV_CONNECTOR_SUITE.check
def check_loads_hold_what_was_saved(factory: ConnectorFactory) -> None:
    """Blocks come back from the tiers (the device alone thrashes on this workload) and
    every loaded block holds its prefix's K/V; idle afterwards."""
    model = _run(factory)
    expect(model.loaded > 0, "no block was ever loaded from a tier: the workload's prefixes outgrow the device")
    expect(not model.bad_loads, f"{len(model.bad_loads)} loaded blocks hold another prefix's K/V")


@KV_CONNECTOR_SUITE.check
def check_failed_saves_are_never_loaded(factory: ConnectorFactory) -> None:
    """A save the device side reports failed is forgotten: no later load reads it."""
    model = _run(factory, wrap=lambda w: FlakyWorker(w, fail_every=3))
    expect(not model.bad_loads, f"{len(model.bad_loads)} loads read a slot whose save failed")


@KV_CONNECTOR_SUITE.check
def check_failed_loads_leave_nothing_held(factory: ConnectorFactory) -> None:
    """Every load failing: the requests recompute (nothing published from a failed load)
    and the idle check holds."""
    model = _run(factory, wrap=lambda w: FlakyWorker(w, fail_loads=True))
    expect(not model.bad_loads, "a failed load's block was read as valid")


@KV_CONNECTOR_SUITE.check
def check_reset_forgets_every_tier(factory: ConnectorFactory) -> None:
    """After ``reset_prefix_cache`` no prefix is found in any tier."""
    with tempfile.TemporaryDirectory() as folder:
        model = TierDeviceModel(factory, folder)
        work = _workload(1, 30)
        for tokens in work:
            model.serve(tokens)
        model.manager.transfer_idle(model.worker)
        expect(model.manager.reset_prefix_cache(), "reset_prefix_cache refused with no request live")
        hits = [model.serve(tokens) for tokens in work[:1]]
        model.finish()
        model.manager.close()
    expect(hits == [0], f"a prefix was found after the reset: {hits[0]} tokens")


@KV_CONNECTOR_SUITE.check
def check_events_name_what_moved(factory: ConnectorFactory) -> None:
    """Stored events for the device and at least one lower tier; every removed key was
    stored before in the same medium."""
    model = _run(factory)
    events = model.manager.take_kv_events()
    stored: dict[str, set[bytes]] = {}
    for ev in events:
        if ev.kind == "stored":
            stored.setdefault(ev.medium, set()).update(ev.keys)
        elif ev.kind == "removed":
            missing = [k for k in ev.keys if k not in stored.get(ev.medium, set())]
            expect(not missing, f"{len(missing)} {ev.medium} keys removed before any stored event")
    expect("device" in stored and len(stored) > 1, f"stored events only for {sorted(stored)}")
