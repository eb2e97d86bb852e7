"""TieredKVCacheManager: the device pool's manager with a KV connector under it — prefix
hits reach past the device into the tiers."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING

from deepinfer_kit.cache.hashing import BlockHasher
from deepinfer_kit.cache.manager import BlockKVCacheManager
from deepinfer_kit.cache.prefix_state import PrefixState
from deepinfer_kit.cache.protocols import BlockAllocator, PrefixIndex, wrapped_chain
from deepinfer_kit.cache.tiers.protocols import KVConnectorScheduler, KVConnectorWorker
from deepinfer_kit.cache.tiers.records import KVEvent, TierStats, TransferOutput, TransferPlan
from deepinfer_kit.errors import ConfigError, InvariantError
from deepinfer_kit.request import Request

__all__ = ["TieredKVCacheManager", "chain_keys", "tiered"]


def chain_keys(hasher: BlockHasher, tokens: Sequence[int], context: Hashable, block_size: int,
               num_blocks: int, memo: list[bytes] | None = None) -> list[bytes]:
    """The chained identities of the first ``num_blocks`` full blocks of ``tokens``:
    key ``i`` hashes ``context`` and every token up to the end of block ``i`` (BLAKE2b
    under the tiers' hash key). What the tiers, their files and the KV events name a block
    by; a router with the same key computes them for a prompt. ``memo`` (one sequence's,
    only growing) is extended and returned. O(new blocks)."""
    keys = memo if memo is not None else []
    hasher.extend_chain(keys, tokens, num_blocks, block_size, hasher.root(context))
    return keys


class TieredKVCacheManager(BlockKVCacheManager):
    """A :class:`BlockKVCacheManager` whose prefix match continues into a
    :class:`KVConnectorScheduler`'s tiers.

    ``match_prefix`` = the device index's hit plus the blocks right after it that the
    connector can load this round; ``allocate`` takes the device hit by reference,
    allocates fresh blocks for the loaded ones (the connector queues their loads, which
    the round runs before its forward) and the rest as usual. Publishing a block and
    evicting one are reported to the connector (write-through / write-back points). The
    scheduler drains the round's copies with :meth:`drain_kv_transfers` and hands the
    device side's report to :meth:`finish_kv_transfers`. Prompt-logprob requests read no
    tier (every prompt position must be computed).

    Args:
        allocator, index: as :class:`BlockKVCacheManager` (``index`` required: tiers hold
            published blocks).
        connector: the scheduler side of the KV connector.
        hash_key: the key of the block identities (shared by engines sharing a tier).

    Raises:
        ConfigError: no prefix index, or a block size mismatch.
    """

    __slots__ = ("_connector", "_hasher", "_keys", "_dev_keys", "_matched", "_resetting", "_idle_rounds",
                 "_watched", "_owed", "plan_hook", "save_filter")

    def __init__(self, allocator: BlockAllocator, index: PrefixIndex | None,
                 connector: KVConnectorScheduler, *, hash_key: bytes | None = None) -> None:
        if index is None:
            raise ConfigError("kv_tiers needs enable_prefix_caching=True: the tiers hold published blocks")
        super().__init__(allocator, index)
        self._connector = connector
        self._hasher = BlockHasher(hash_key)
        self._keys: dict[str, list[bytes]] = {}  # request id -> chained keys (memo)
        self._dev_keys: dict[int, tuple[bytes, bool]] = {}  # published device block -> (key, writable)
        self._matched: dict[str, tuple[int, int]] = {}  # request -> (device blocks, tier blocks)
        self._resetting = False
        self._idle_rounds = 0  # transfer_idle's rounds, numbered -1, -2, ...
        self._watched: set[str] = set()  # live requests whose prompt saves are watched
        self._owed: dict[str, list[bytes]] = {}  # finished watched request -> its prompt's keys
        self.plan_hook: Callable[[TransferPlan], None] | None = None
        """Completes each round's plan before it leaves (a hybrid cache over these tiers adds
        its sliding groups' blocks, ``cache.tiers.hybrid``)."""
        self.save_filter: Callable[[int], bool] | None = None
        """Whether a device block may be saved now, asked as its save would be queued (at
        publish; at eviction when the connector's ``saves_on_eviction``, default True): a
        hybrid cache answers False when a window of it is gone."""

    @property
    def connector(self) -> KVConnectorScheduler:
        """The injected connector (read it; the manager drives it)."""
        return self._connector

    @property
    def tier_stats(self) -> TierStats:
        """The connector's counters (live)."""
        return self._connector.stats

    def _request_keys(self, request: Request, num_blocks: int) -> list[bytes]:
        memo = self._keys.setdefault(request.request_id, [])
        return chain_keys(self._hasher, request.all_token_ids, request.cache_context, self._P, num_blocks, memo)

    def on_arrival(self, request: Request) -> None:
        """A request was queued (the scheduler's ``add``): its prompt's lower-tier blocks
        start loading toward the host. Counts no prefix query."""
        if request.params.prompt_logprobs is not None:
            return
        limit = (request.num_tokens - 1) // self._P
        if limit <= 0:
            return
        index = self._index
        assert index is not None
        first = len(index.match(request.all_token_ids, context=request.cache_context, max_blocks=limit,
                                touch=False))
        self._connector.on_arrival(request, self._request_keys(request, limit), first)

    def match_prefix(self, request: Request) -> int:
        """The device hit plus the connector's loadable blocks after it, in tokens."""
        device = super().match_prefix(request)
        rid = request.request_id
        if request.params.prompt_logprobs is not None:
            return device
        limit = (request.num_tokens - 1) // self._P
        first = device // self._P
        if first >= limit:
            self._matched[rid] = (first, 0)
            return device
        extra = self._connector.get_num_new_matched_tokens(request, self._request_keys(request, limit), first)
        self._matched[rid] = (first, extra)
        return device + extra * self._P

    def _split(self, request: Request, num_cached_tokens: int) -> tuple[int, int]:
        """``num_cached_tokens`` as (device tokens, tier blocks) of the last match."""
        if request.block_table or num_cached_tokens <= 0:
            return num_cached_tokens, 0
        first, extra = self._matched.get(request.request_id, (0, 0))
        device = first * self._P
        if num_cached_tokens <= device:
            return num_cached_tokens, 0
        tier = num_cached_tokens - device
        if tier % self._P or tier // self._P > extra:
            raise InvariantError(
                f"request {request.request_id!r}: num_cached_tokens={num_cached_tokens} is not what the last "
                f"match_prefix returned ({device} on the device + {extra} tier blocks)")
        return device, tier // self._P

    def can_allocate(self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        """As :meth:`BlockKVCacheManager.can_allocate`; tier blocks need fresh blocks."""
        device, tier = self._split(request, num_cached_tokens)
        return super().can_allocate(request, num_new_tokens + tier * self._P, device)

    def allocate(self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0) -> list[tuple[int, int]]:
        """As :meth:`BlockKVCacheManager.allocate`; the tier blocks of the last match get
        fresh device blocks whose loads the connector queues for this round."""
        fresh = not request.block_table
        device, tier = self._split(request, num_cached_tokens)
        copies = super().allocate(request, num_new_tokens + tier * self._P, device)
        if fresh and self._matched.pop(request.request_id, None) is not None:
            first = device // self._P
            self._connector.update_state_after_alloc(request, request.block_table[first:first + tier])
        hit = getattr(self._connector, "on_device_hit", None)  # optional (docs/kv_connector.md)
        if fresh and hit is not None and device >= self._P:
            first = device // self._P
            keys, blocks = self._request_keys(request, first)[:first], request.block_table[:first]
            if self.save_filter is None:
                hit(request, keys, blocks)
            else:  # a hybrid cache: a block whose window is gone cannot be saved now
                hit(request, keys, blocks, [self.save_filter(b) for b in blocks])
        return copies

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish as the base class does, then tell the connector which blocks were
        published (their keys, whether the request lets them go down)."""
        st = request.prefix_state
        before = st.num_published if type(st) is PrefixState else 0
        super().cache_full_blocks(request, num_tokens)
        st = request.prefix_state
        after = st.num_published if type(st) is PrefixState else 0
        if after <= before:
            return
        keys = self._request_keys(request, after)[before:after]
        table = request.block_table[before:after]
        index = self._index
        assert index is not None
        kv = request.kv_params
        writable = kv is None or kv.write
        kept_keys, kept = [], []
        for key, block in zip(keys, table):
            if index.contains(block) and block not in self._dev_keys:
                self._dev_keys[block] = (key, writable)
                kept_keys.append(key)
                kept.append(block)
        savable = [self.save_filter(b) for b in kept] if self.save_filter is not None else []
        if all(savable):
            self._connector.on_published(request, before, kept_keys, kept)
        else:
            self._connector.on_published(request, before, kept_keys, kept, savable)

    def _evict(self, index: PrefixIndex, n: int) -> None:
        """Evict as the base class does; the victims' keys go to the connector first
        (their bytes are intact until this round's forward: a save queued now runs
        before it)."""
        victims = index.evict(n)
        keys, blocks, writable = [], [], []
        check = self.save_filter if getattr(self._connector, "saves_on_eviction", True) else None
        for b in victims:
            entry = self._dev_keys.pop(b, None)
            if entry is not None:
                keys.append(entry[0])
                blocks.append(b)
                writable.append(entry[1] and not self._resetting and (check is None or check(b)))
        if keys:
            self._connector.on_evicted(keys, blocks, writable)
        self._allocator.free(victims)
        self._epoch += 1

    def free(self, request: Request) -> None:
        """Release as the base class does; the connector drops the request's pins. A
        watched request's prompt keys are kept for :meth:`settled_saves`."""
        rid = request.request_id
        if rid in self._watched:
            self._watched.discard(rid)
            full = min(request.num_prompt_tokens, request.num_tokens - 1) // self._P
            self._owed[rid] = self._request_keys(request, full)[:full] if full > 0 else []
        super().free(request)
        self._keys.pop(rid, None)
        self._matched.pop(rid, None)
        self._connector.request_finished(request)

    def watch_saves(self, request_id: str) -> None:
        """Track request ``request_id`` (queued, not finished) for :meth:`settled_saves`:
        a prefill server answers a ``save_prompt`` request once its prompt is down."""
        self._watched.add(request_id)

    def settled_saves(self, request_id: str) -> int | None:
        """A watched request's prompt saves, once settled: ``None`` while it runs or any of
        its full prompt blocks is queued for a save, being saved, owed to disk or being
        written there (the connector's ``keys_pending``); then how many of its leading
        prompt blocks another engine can read (``keys_down``; the rest failed, were
        refused or dropped: a reader computes them), and the request is forgotten. ``0``
        for a request not watched. A connector without those methods answers ``0`` once
        the request finished."""
        if request_id in self._watched:
            return None
        keys = self._owed.get(request_id)
        if keys is None:
            return 0
        pending = getattr(self._connector, "keys_pending", None)
        if keys and pending is not None and pending(keys):
            return None
        del self._owed[request_id]
        down = getattr(self._connector, "keys_down", None)
        return int(down(keys)) if keys and down is not None else 0

    def drain_kv_transfers(self, step_id: int) -> TransferPlan:
        """Round ``step_id``'s device <-> host copies (the scheduler puts them on its plan),
        completed by :attr:`plan_hook`."""
        plan = self._connector.build_transfers(step_id)
        if self.plan_hook is not None:
            self.plan_hook(plan)
        return plan

    def finish_kv_transfers(self, step_id: int, output: TransferOutput | None) -> None:
        """Round ``step_id`` committed, with the device side's report since the last one
        (the scheduler, at every commit of a non-empty round)."""
        self._connector.update_from_output(step_id, output)

    def take_kv_events(self) -> list[KVEvent]:
        """KV events since the last call (device, host, disk), oldest first."""
        return self._connector.take_events()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block of the device and of every tier; False (nothing
        changed) while a block is referenced."""
        self._resetting = True
        try:
            done = super().reset_prefix_cache()
        finally:
            self._resetting = False
        if done:
            self._dev_keys.clear()
            self._connector.reset()
        return done

    def transfer_idle(self, worker: KVConnectorWorker) -> None:
        """Run the queued copies now, through ``worker``, outside any round — for an engine
        with no round in flight that must push its last published blocks down (the
        prefill side of disaggregation, a benchmark's end); then wait for the disk writes.
        Nothing else may touch the pool meanwhile (no forward runs)."""
        self._idle_rounds -= 1  # a step id no scheduled round has
        step = self._idle_rounds
        plan = self.drain_kv_transfers(step)
        if plan:
            worker.start_save_kv(plan)
            worker.start_load_kv(plan)
            worker.wait_for_load()
        self.finish_kv_transfers(step, worker.get_finished())
        drain = getattr(self._connector, "drain", None)
        if drain is not None:
            drain()

    def close(self) -> None:
        """Finish the tiers' queued I/O and stop their threads (``Engine.close``)."""
        self._connector.close()

    def check_integrity(self, requests: Iterable[Request] | None = None) -> None:
        """The base class's checks; the idle check (``requests == ()``) also checks that the
        connector holds nothing for a request.

        Raises:
            InvariantError: naming the blocks, counts or tier slots at fault.
        """
        reqs = list(requests) if requests is not None else None
        super().check_integrity(reqs)
        if reqs is not None and not reqs:
            self._connector.check_idle()


if TYPE_CHECKING:
    from deepinfer_kit.cache.protocols import KVCacheManager

    _check: type[KVCacheManager] = TieredKVCacheManager


def tiered(cache: object) -> TieredKVCacheManager | None:
    """The :class:`TieredKVCacheManager` ``cache`` is, or wraps (down the ``inner`` chain: a
    hybrid cache over the tiers); ``None`` for a cache without tiers. Pure."""
    return next((c for c in wrapped_chain(cache) if isinstance(c, TieredKVCacheManager)), None)
