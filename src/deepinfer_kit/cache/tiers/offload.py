"""OffloadConnector: the scheduler side of the host and disk tiers — what goes down,
what comes back up, and when."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from deepinfer_kit.cache.tiers.admission import SeenTwice
from deepinfer_kit.cache.tiers.bytes import HostBytes
from deepinfer_kit.cache.tiers.config import TierConfig
from deepinfer_kit.cache.tiers.disk_tier import MISSING, DiskTier
from deepinfer_kit.cache.tiers.prefetch import Prefetch
from deepinfer_kit.cache.tiers.records import EventLog, KVEvent, TierStats, TransferOutput, TransferPlan
from deepinfer_kit.cache.tiers.save_ledger import SaveLedger
from deepinfer_kit.cache.tiers.slots import TierSlots, eviction_policy
from deepinfer_kit.errors import InvariantError
from deepinfer_kit.request import Request

__all__ = ["OffloadConnector"]


class OffloadConnector:
    """A :class:`~deepinfer_kit.cache.tiers.protocols.KVConnectorScheduler` over a host
    tier (``slab``: its bytes — :class:`~deepinfer_kit.cache.tiers.slab_bytes.RankSlabs`
    over each rank's ``[host_blocks, *block]`` CPU tensor the device side's
    :class:`~deepinfer_kit.cache.tiers.host_worker.HostTransferWorker` copies into, or
    the simulator's :class:`~deepinfer_kit.cache.tiers.bytes.NoBytes`) and an optional
    :class:`DiskTier` under it (see :class:`TierConfig` for the policies). Imports no torch.

    Where a block is: the device prefix index (device), :attr:`host` and the disk tier's
    slots — keyed by the same chained identity, so a block found in several tiers is the
    same K/V. Data only moves device <-> host in rounds (queued here, run by the device
    side before the round's forward) and host <-> disk in I/O threads. Every read of a
    lower tier is checked (disk checksums); whatever is late, missing or damaged is
    recomputed by the engine, never waited for past ``prefetch_timeout_s`` after arrival.

    Args:
        config: the tiers' sizes and policies.
        slab: the host tier's bytes.
        disk: the disk tier, or None.
        block_size: tokens per block.
        agree: for ranks that each schedule alike (``worker="launched"``): called with the
            count of tier blocks this rank could load for a request, returns the count every
            rank can (a collective MIN); the rest are released. ``None``: one scheduler.
    """

    def __init__(self, config: TierConfig, slab: HostBytes, disk: DiskTier | None, block_size: int, *,
                 agree: Callable[[int], int] | None = None) -> None:
        self._cfg = config
        self._agree = agree
        self._slab = slab
        self.host = TierSlots(config.host_blocks, eviction_policy(config.host_eviction))
        self.disk = disk
        self._admission = SeenTwice(config.admission_window) if config.admission == "seen_twice" else None
        self._P = block_size
        self._through = config.write_policy == "write_through"
        self._ledger = SaveLedger()  # host saves from queued to reported
        self._loads: list[tuple[int, int]] = []
        self._load_pins: list[int] = []  # sources of loads queued for the round being planned
        self._round_pins: dict[int, list[int]] = {}  # step id -> its loads' sources, held until its commit
        self._match: dict[str, tuple[list[int], list[bool]]] = {}  # request -> pinned slots, each read from disk?
        self._prefetch = Prefetch(disk, config.prefetch_timeout_s, config.prefetch == "wait") if disk else None
        self._forced: set[bytes] = set()  # save_prompt keys: to disk whatever the policy
        self._events = EventLog()
        self._stats = TierStats()

    # ------------------------------------------------------------------ reads

    def on_arrival(self, request: Request, keys: Sequence[bytes], first: int) -> None:
        """Start reading, in the I/O threads, the prompt blocks the disk tier holds (and,
        for ``load_remote``, the blocks another engine writes: all, or ``remote_blocks``)."""
        if self._prefetch is None:
            return
        kv = request.kv_params
        remote = 0 if kv is None or not kv.load_remote else len(keys) if kv.remote_blocks is None else kv.remote_blocks
        self._prefetch.start(request.request_id, keys, first, remote, self._in_host)

    def _in_host(self, key: bytes) -> bool:
        return self.host.slot(key) is not None

    def get_num_new_matched_tokens(self, request: Request, keys: Sequence[bytes], first: int) -> int:
        """Blocks after the device's ``first`` hits that the host tier holds or the disk
        tier delivered in time, in order, each pinned for this request (see the
        Protocol). Disk blocks that arrived are copied into the host tier first."""
        rid = request.request_id
        self._unpin_match(rid)
        self._poll_disk()
        if self._admission is not None:
            self._admission.observe(keys[:first])
        slots: list[int] = []
        from_disk: list[bool] = []
        j, n = first, len(keys)
        while j < n:
            slot = self.host.slot(keys[j])
            if slot is not None:
                self.host.pin(slot)
                slots.append(slot)
                from_disk.append(False)
                j += 1
                continue
            got, complete = self._fetch(request, keys, j)
            slots.extend(got)
            from_disk.extend([True] * len(got))
            j += len(got)
            if not got or not complete:
                break
        if self._agree is not None:  # ranks scheduling alike take what every one of them holds
            n = self._agree(len(slots))
            for s in slots[n:]:
                self.host.unpin(s)
            slots, from_disk = slots[:n], from_disk[:n]
        self._match[rid] = (slots, from_disk)
        return len(slots)

    def _fetch(self, request: Request, keys: Sequence[bytes], j: int) -> tuple[list[int], bool]:
        """Read the run of disk blocks from ``keys[j]`` into the host tier (waiting per
        the prefetch policy); returns their slots, pinned, and whether the whole run came."""
        disk, pre = self.disk, self._prefetch
        if disk is None or pre is None:
            return [], False
        rid = request.request_id
        run = pre.run(rid, keys, j, self._in_host)
        if not run:
            return [], False
        got: list[int] = []
        for key, fut in run:
            if not fut.done():
                self._stats.late_reads += 1
                return got, False
            pre.taken(rid, key)
            data = fut.result()
            if data is MISSING:
                self._stats.failed_reads += 1
                if disk.has(key):
                    disk.drop(key)
                    self._events.add("removed", "disk", [key])
                return got, False
            slot = self._host_put(key, data)
            if slot is None:
                return got, False
            self._note_evicted_disk(disk.adopt(key))
            self.host.pin(slot)
            got.append(slot)
        return got, True

    def update_state_after_alloc(self, request: Request, blocks: Sequence[int]) -> None:
        """Queue the loads into ``blocks`` for this round; release what was not taken."""
        slots, from_disk = self._match.pop(request.request_id, ([], []))
        use = slots[:len(blocks)]
        for s in slots[len(blocks):]:
            self.host.unpin(s)
        for s, b in zip(use, blocks):
            self._loads.append((s, b))
            self.host.touch(s)
        self._load_pins.extend(use)
        disk_used = sum(from_disk[:len(use)])
        self._stats.disk_hits += disk_used
        self._stats.host_hits += len(use) - disk_used
        self._stats.loaded_tokens += len(use) * self._P

    # ------------------------------------------------------------------ writes

    def on_published(self, request: Request, start: int, keys: Sequence[bytes], blocks: Sequence[int],
                     savable: Sequence[bool] | None = None) -> None:
        """Device events; with write-through (or ``save_prompt``) queue the saves of the
        admitted blocks (not those ``savable`` rules out). ``start``: block index of
        ``keys[0]`` in the request."""
        self._events.add("stored", "device", keys)
        kv = request.kv_params
        if kv is not None and not kv.write:
            return
        prompt_blocks = request.num_prompt_tokens // self._P if kv is not None and kv.save_prompt else 0
        for i, (key, block) in enumerate(zip(keys, blocks)):
            force = start + i < prompt_blocks
            if not (self._through or force):
                return
            self._save(key, block, force, savable is None or savable[i])

    @property
    def saves_on_eviction(self) -> bool:
        """Whether :meth:`on_evicted` queues saves (write-back); with write-through it
        only records the events."""
        return not self._through

    def on_evicted(self, keys: Sequence[bytes], blocks: Sequence[int], writable: Sequence[bool]) -> None:
        """Device events; with write-back queue the saves of the admitted victims."""
        self._events.add("removed", "device", keys)
        if self._through:
            return
        for key, block, ok in zip(keys, blocks, writable):
            if ok:
                self._save(key, block, False)

    def _save(self, key: bytes, block: int, force: bool, savable: bool = True) -> None:
        """Queue ``block``'s save to the host tier as ``key`` unless it is there already
        (then it is a use) or refused (by admission, or not ``savable``: its bytes are not
        all on the device)."""
        slot = self.host.slot(key)
        if slot is not None:
            if self.host.is_ready(slot):
                self.host.touch(slot)
                if force:
                    self._to_disk(key, slot)
            elif force:
                self._forced.add(key)
            return
        if not savable:
            return
        if not force and self._admission is not None and not self._admission.admit(key):
            self._stats.refused += 1
            return
        taken = self.host.take(key)
        if taken is None:
            return  # every host slot is pinned or saving: skip (a cache may)
        slot, evicted = taken
        if evicted is not None:
            self._demote(evicted, slot)
        self._ledger.queue(block, slot, key)
        if force:
            self._forced.add(key)

    def _host_put(self, key: bytes, data: object) -> int | None:
        """A host slot holding ``data`` (bytes read from disk) as ``key``, ready."""
        taken = self.host.take(key)
        if taken is None:
            return None
        slot, evicted = taken
        if evicted is not None:
            self._demote(evicted, slot)
        self._slab.write(slot, data)
        self.host.mark_ready(slot)
        self._events.add("stored", "host", [key])
        return slot

    def _demote(self, key: bytes, slot: int) -> None:
        """``key`` leaves host ``slot`` for room: with write-back it goes to disk first."""
        self._stats.evicted_host += 1
        self._events.add("removed", "host", [key])
        if not self._through or key in self._forced:
            self._to_disk(key, slot)
        else:
            self._forced.discard(key)

    def _to_disk(self, key: bytes, slot: int) -> None:
        """Write host ``slot``'s bytes to disk as ``key`` unless the disk holds it (or there
        is no disk); ``key`` is no longer owed to disk either way."""
        disk = self.disk
        self._forced.discard(key)
        if disk is not None and not disk.has(key):
            self._note_evicted_disk(disk.write(key, self._slab.read(slot)))

    def _note_evicted_disk(self, result: bytes | None | bool) -> None:
        if isinstance(result, bytes):
            self._stats.evicted_disk += 1
            self._events.add("removed", "disk", [result])

    def keys_pending(self, keys: Sequence[bytes]) -> bool:
        """Whether any of ``keys`` is being saved, owed to disk or written there (not readable yet)."""
        self._poll_disk()
        saving, disk = self._ledger.keys(), self.disk
        return any(k in saving or k in self._forced or (disk is not None and disk.is_writing(k)) for k in keys)

    def keys_down(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` another engine can read now (on disk; host without one)."""
        tier = self.disk.slots if self.disk is not None else self.host
        return next((i for i, k in enumerate(keys) if not tier.holds(k)), len(keys))

    def _poll_disk(self) -> None:
        if self.disk is None:
            return
        written, failed = self.disk.poll_writes()
        if written:
            self._stats.saved_disk += len(written)
            self._events.add("stored", "disk", written)
        self._stats.failed_writes += len(failed)

    # ------------------------------------------------------------------ rounds

    def build_transfers(self, step_id: int) -> TransferPlan:
        """Drain the queued saves and loads into round ``step_id``'s plan; the loads'
        sources stay pinned until that round commits (the device side may read them on
        another thread while later rounds are planned)."""
        plan = TransferPlan(self._ledger.drain(step_id), self._loads)
        self._loads = []
        if self._load_pins:
            self._round_pins[step_id] = self._load_pins
            self._load_pins = []
        return plan

    def update_from_output(self, step_id: int, output: TransferOutput | None) -> None:
        """Round ``step_id`` committed (in order): its and older rounds' load sources are
        released. ``output`` (the device side's report since the last; None: nothing):
        saved slots become readable (to disk too with write-through); failed ones, and
        saves of this round or older it does not name (their round failed before running
        them; every round's when ``step_id < 0``, idle), are forgotten (:class:`SaveLedger`)."""
        for sid in [k for k in self._round_pins if k <= step_id]:
            for s in self._round_pins.pop(sid):
                self.host.unpin(s)
        if output is not None:
            self._settle(output)
        if output is not None or step_id < 0:
            for s, key in self._ledger.conclude(step_id):
                self._forget_save(s, key)
        self._poll_disk()

    def _settle(self, output: TransferOutput) -> None:
        saved, failed = self._ledger.settle(output)
        for s, key, stale in saved:
            if self.host.key(s) != key:
                continue
            if stale:
                self.host.drop(s)
                continue
            self.host.mark_ready(s)
            self._stats.saved_host += 1
            self._events.add("stored", "host", [key])
            if self._through or key in self._forced:
                self._to_disk(key, s)
        for s, key in failed:
            self._forget_save(s, key)

    def _forget_save(self, slot: int, key: bytes) -> None:  # failed or never ran: free the slot
        self._forced.discard(key)
        if self.host.key(slot) == key:
            self.host.drop(slot)

    def request_finished(self, request: Request) -> None:
        """Release the request's pins and cancel its reads not yet started."""
        rid = request.request_id
        self._unpin_match(rid)
        if self._prefetch is not None:
            self._prefetch.forget(rid)

    def _unpin_match(self, rid: str) -> None:
        for s in self._match.pop(rid, ([], []))[0]:
            self.host.unpin(s)

    def take_events(self) -> list[KVEvent]:
        """The events since the last call, oldest first."""
        return self._events.take()

    @property
    def stats(self) -> TierStats:
        """Cumulative counters (live)."""
        return self._stats

    def reset(self) -> None:
        """Forget every tier block (pinned ones once released; saving ones once saved)."""
        for s in range(self.host.capacity):
            if self.host.key(s) is None:
                continue
            if self._ledger.saving(s):
                self._ledger.mark_stale(s)
            else:
                self.host.drop(s)
        self._forced.clear()
        self._events.add("cleared", "host")
        if self.disk is not None:
            self.disk.clear()
            self._events.add("cleared", "disk")

    def check_idle(self) -> None:
        """Nothing pinned or queued for a request, and each tier's slots add up.

        Raises:
            InvariantError: naming what is held.
        """
        reads = self._prefetch.num_requests if self._prefetch is not None else 0
        if self._match or self._load_pins or self._round_pins or reads or self.host.num_pinned:
            raise InvariantError(
                f"kv tiers idle check: {len(self._match)} matches, "
                f"{len(self._load_pins) + sum(map(len, self._round_pins.values()))} loads, "
                f"{reads} requests' reads and {self.host.num_pinned} pinned host slots held")
        self.host.check()
        if self.disk is not None:
            self.disk.slots.check()

    def drain(self) -> None:
        """Wait for the disk writes in flight and settle them (tests, benchmarks)."""
        if self.disk is not None:
            self.disk.drain()
            self._poll_disk()

    def close(self) -> None:
        """Finish the queued disk I/O and stop its threads."""
        if self.disk is not None:
            self.disk.close()


if TYPE_CHECKING:
    from deepinfer_kit.cache.tiers.protocols import KVConnectorScheduler

    _check: type[KVConnectorScheduler] = OffloadConnector
