"""The KV connector: the one Protocol through which KV leaves and re-enters the device
pool — the scheduler side decides what moves and when, the device side moves it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from deepinfer_kit.cache.tiers.records import KVEvent, TierStats, TransferOutput, TransferPlan
from deepinfer_kit.request import Request

__all__ = ["KVConnectorScheduler", "KVConnectorWorker", "LayerwiseKVConnectorWorker"]


class KVConnectorScheduler(Protocol):
    """The scheduler side of a KV connector, called by
    :class:`~deepinfer_kit.cache.tiers.manager.TieredKVCacheManager` (never by the
    scheduler directly), all on the scheduler's thread.

    Blocks are named by their chained keys (:func:`~deepinfer_kit.cache.tiers.keys.chain_keys`):
    key ``i`` of a request identifies its token prefix up to the end of block ``i``. The
    connector owns no device block: it is told which device blocks hold what, queues
    copies for the device side (:meth:`build_transfers`), and hears back what was done
    (:meth:`update_from_output`). It must never make a request wait forever or fail: a
    block it cannot deliver in time is recomputed by the engine.
    """

    def on_arrival(self, request: Request, keys: Sequence[bytes], first: int) -> None:
        """A request was queued; ``keys`` are its prompt's full blocks (at most
        ``num_tokens - 1`` tokens' worth), ``keys[:first]`` are on the device now. Start
        fetching what a lower tier holds (prefetch). Mutates the connector only."""
        ...

    def get_num_new_matched_tokens(self, request: Request, keys: Sequence[bytes], first: int) -> int:
        """At an admission attempt: how many blocks after the device's ``first`` hits,
        ``keys[first:first + n]``, the connector can load into the device this round.

        The blocks counted are held for the request (pinned) until
        :meth:`update_state_after_alloc` or the next call for the same request or
        :meth:`request_finished`. May wait, bounded by the connector's deadline, for a
        read started at :meth:`on_arrival`."""
        ...

    def update_state_after_alloc(self, request: Request, blocks: Sequence[int]) -> None:
        """The device blocks allocated for the first ``len(blocks)`` blocks the last
        :meth:`get_num_new_matched_tokens` counted (the rest are released): queue their
        loads for the round being planned."""
        ...

    def on_published(self, request: Request, start: int, keys: Sequence[bytes], blocks: Sequence[int],
                     savable: Sequence[bool] | None = None) -> None:
        """``blocks`` (device) were published with ``keys`` after the round that wrote
        them committed; ``request`` wrote or loaded them; ``keys[0]`` is the request's
        block ``start``. The write-through point. ``savable[i]`` False (given only when
        some is): block ``i`` must not be saved (a hybrid cache no longer holds its
        whole window)."""
        ...

    def on_evicted(self, keys: Sequence[bytes], blocks: Sequence[int], writable: Sequence[bool]) -> None:
        """Published device blocks were evicted from the device index while a round is
        planned: their bytes stay intact until that round's forward, and a save queued
        now runs before it. ``writable[i]`` False: block ``i`` came from a request that
        opted out of tier writes. The write-back point."""
        ...

    def request_finished(self, request: Request) -> None:
        """The request released its blocks (finished, aborted or preempted): drop its
        pins and pending reads."""
        ...

    def build_transfers(self, step_id: int) -> TransferPlan:
        """Drain the copies queued since the last call into round ``step_id``'s plan.
        Called once per non-empty round, at the end of planning; the round runs them
        before its forward, in plan order after earlier rounds'. A source the loads read
        must stay untouched until :meth:`update_from_output` for this round (under an
        overlapped executor the device side runs while later rounds are planned)."""
        ...

    def update_from_output(self, step_id: int, output: TransferOutput | None) -> None:
        """Round ``step_id`` committed (in step order), with what the device side reported
        since the last report (``None``: nothing)."""
        ...

    def take_events(self) -> list[KVEvent]:
        """The KV events since the last call, oldest first (a router's feed)."""
        ...

    @property
    def stats(self) -> TierStats:
        """Cumulative counters (live record)."""
        ...

    def reset(self) -> None:
        """Forget every block of every tier (``reset_prefix_cache``); pinned ones are
        kept until released."""
        ...

    def check_idle(self) -> None:
        """With no request live: nothing pinned and every tier's accounting whole.

        Raises:
            InvariantError: naming what is still held.
        """
        ...

    def close(self) -> None:
        """Finish queued I/O and stop its threads (the engine's close)."""
        ...


class KVConnectorWorker(Protocol):
    """The device side of a KV connector, called by the model runner around each round's
    forward, on the runner's thread and stream.

    The runner calls :meth:`start_save_kv` first, then performs the round's copy-on-write
    copies, then :meth:`start_load_kv`, then :meth:`wait_for_load` before the forward,
    and :meth:`get_finished` when the round's result is built. A worker that also has
    :class:`LayerwiseKVConnectorWorker`'s ``wait_for_layer_load`` gets, in a round with
    loads and an eager forward, that call before each layer first touches its cache
    instead, and :meth:`wait_for_load` after the forward.
    """

    def start_save_kv(self, plan: TransferPlan) -> None:
        """Start copying ``plan.saves`` (device block -> host slot), layer by layer,
        asynchronously to the host where the device allows (CUDA: on the runner's
        stream into pinned memory). Reads the device pool; writes the host tier."""
        ...

    def start_load_kv(self, plan: TransferPlan) -> None:
        """Start copying ``plan.loads`` (host slot -> device block), layer by layer,
        ordered before the forward. Writes the device pool."""
        ...

    def wait_for_load(self) -> None:
        """Return when the loads started are ordered before the forward (a CUDA stream
        dependency or a finished copy)."""
        ...

    def get_finished(self) -> TransferOutput | None:
        """What finished (or failed) since the last call; None when nothing was asked.
        Waits for the saves of the round just run (they precede its forward on the
        stream, so they are done when its tokens are)."""
        ...


class LayerwiseKVConnectorWorker(KVConnectorWorker, Protocol):
    """A device side whose loads land layer by layer, so the forward can start before
    they all have (vLLM's ``wait_for_layer_load``).

    In a round with loads run by an eager forward (not a captured CUDA graph), the runner
    calls :meth:`start_load_kv`, then the forward, during which it calls
    :meth:`wait_for_layer_load` before layer ``i`` first reads or writes its cache, then
    :meth:`wait_for_load` once the forward returned or raised (every load is finished or
    ordered before what follows). Other rounds run as for a :class:`KVConnectorWorker`.
    The runner finds the member with ``getattr``: a worker without it is waited for
    before the forward.
    """

    def wait_for_layer_load(self, layer: int) -> None:
        """Return when the loads of layer ``layer`` (``[0, L)``) are ordered before what
        the caller does next: a CUDA stream dependency, or copied. Called on the runner's
        thread, at most once per layer and round; mutates only the worker's wait state.

        Raises:
            Exception: what the copy raised (the round fails; its requests get errors).
        """
        ...
