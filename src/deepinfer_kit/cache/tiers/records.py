"""Records of the KV tiers: the transfers a round performs, what the device side reports
back, the events a router reads, and the tiers' counters (no torch)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import attrs

__all__ = ["TransferPlan", "TransferOutput", "KVEvent", "EventLog", "TierStats", "MEDIA", "merge_outputs"]

MEDIA = ("device", "host", "disk")


@attrs.define(slots=True, eq=False)
class TransferPlan:
    """The block copies between the device pool and the host tier that one round performs
    before its forward (``SchedulePlan.kv_transfers``).

    The device side runs the saves first (so a device block evicted and handed out again
    this round is read before the round writes it), then the plan's copy-on-write copies,
    then the loads (into blocks allocated this round, read by the forward after them).

    Under a hybrid cache a block id names a full-attention group block; each sliding
    group holds its own block for the blocks its windows read, and a host slot keeps every
    layer of the model (the bytes a cache without groups would keep).

    Attributes:
        saves: ``(device_block, host_slot)``: copy the device block's K/V of every layer
            into the host slot.
        loads: ``(host_slot, device_block)``: copy the host slot into the device block.
        save_groups: per sliding group (a hybrid cache), the group's block holding each
            save's window, aligned with ``saves`` (every save has one in every group).
        load_groups: per sliding group, the group's block each load's window goes to,
            aligned with ``loads``; ``-1`` where the group holds none (the block is outside
            every window of the request: only the other groups' layers are loaded).
    """

    saves: list[tuple[int, int]] = attrs.field(factory=list)
    loads: list[tuple[int, int]] = attrs.field(factory=list)
    save_groups: dict[int, list[int]] = attrs.field(factory=dict)
    load_groups: dict[int, list[int]] = attrs.field(factory=dict)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads)


@attrs.define(slots=True, eq=False)
class TransferOutput:
    """What the device side reports after performing a :class:`TransferPlan`
    (``StepResult.kv_transfers``), read by the scheduler side at commit.

    Attributes:
        saved: host slots whose save finished (their bytes may now be read on the host).
        failed_saves: host slots whose save failed: the scheduler side forgets them.
        failed_loads: device blocks whose load failed; the round's forward then read
            garbage in them, so the scheduler side must recompute the requests holding
            them (the device side reports the round's chunks of those requests as errors
            when it cannot say which is which).
    """

    saved: list[int] = attrs.field(factory=list)
    failed_saves: list[int] = attrs.field(factory=list)
    failed_loads: list[int] = attrs.field(factory=list)


def merge_outputs(outputs: Sequence[TransferOutput | None]) -> TransferOutput | None:
    """One report of the reports of the ranks that ran one round's transfers, each on its
    shard of every block (tensor parallelism; expert-parallel ranks on copies): a slot is
    saved when every rank saved it, and its save failed when any rank's failed or did
    not report it; a load failed when any rank's did (that rank's forward read garbage).
    ``None`` (nothing asked of any rank) when every report is ``None``. Pure."""
    present = [o for o in outputs if o is not None]
    if not present:
        return None
    if len(outputs) == 1:
        return present[0]
    failed_saves = {s for o in present for s in o.failed_saves}
    saved_sets = [set(o.saved) if o is not None else set() for o in outputs]
    order = list(dict.fromkeys(s for o in present for s in o.saved))
    everywhere = set.intersection(*saved_sets)
    saved = [s for s in order if s in everywhere and s not in failed_saves]
    failed = sorted(failed_saves | {s for s in order if s not in everywhere})
    failed_loads = sorted({b for o in present for b in o.failed_loads})
    return TransferOutput(saved=saved, failed_saves=failed, failed_loads=failed_loads)


@attrs.frozen(slots=True)
class KVEvent:
    """A change of what one medium holds, for a router choosing the engine with the most
    of a prompt cached (``engine.cache.take_kv_events()``, a server's ``GET /v1/kv_events``;
    vLLM's BlockStored / BlockRemoved / AllBlocksCleared).

    Attributes:
        kind: ``"stored"``, ``"removed"`` or ``"cleared"`` (every block of ``medium``).
        medium: ``"device"``, ``"host"`` or ``"disk"``.
        keys: the blocks' chained identities (:func:`~deepinfer_kit.cache.tiers.keys.chain_keys`
            of their token prefix); empty for ``"cleared"``.
    """

    kind: str
    medium: str
    keys: tuple[bytes, ...] = ()


class EventLog:
    """The KV events not yet taken, oldest first; past ``limit`` the oldest are dropped
    (a reader that never takes them costs bounded memory)."""

    def __init__(self, limit: int = 1 << 16) -> None:
        self._events: deque[KVEvent] = deque(maxlen=limit)

    def add(self, kind: str, medium: str, keys: Sequence[bytes] = ()) -> None:
        """Record one event (``"cleared"`` without keys; other kinds only with some)."""
        if keys or kind == "cleared":
            self._events.append(KVEvent(kind, medium, tuple(keys)))

    def take(self) -> list[KVEvent]:
        """The events since the last call, oldest first."""
        out = list(self._events)
        self._events.clear()
        return out


@attrs.define(slots=True)
class TierStats:
    """Cumulative counters of the tiers (``TieredKVCacheManager.tier_stats``).

    Attributes:
        host_hits, disk_hits: blocks a request took from the host tier (resident there)
            and from the disk tier (read into the host tier for it).
        saved_host, saved_disk: blocks written to each tier.
        evicted_host, evicted_disk: blocks dropped from each tier for room.
        refused: blocks the admission policy kept out.
        failed_reads: disk blocks found missing, truncated or corrupt at read (recomputed).
        late_reads: disk blocks still being read (or written elsewhere) at the deadline
            (recomputed).
        failed_writes: disk writes that raised (the block is not on disk).
        loaded_tokens: tokens whose KV a request took from a tier instead of computing.
    """

    host_hits: int = 0
    disk_hits: int = 0
    saved_host: int = 0
    saved_disk: int = 0
    evicted_host: int = 0
    evicted_disk: int = 0
    refused: int = 0
    failed_reads: int = 0
    late_reads: int = 0
    failed_writes: int = 0
    loaded_tokens: int = 0
