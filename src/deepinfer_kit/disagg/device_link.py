"""The device link's two ends as engine components: a prefill engine sending its prompt
blocks from device memory (``components.kv_connector=link_sender(...)``) and a decode
engine receiving them into landing slots on its device (``link_receiver(...)``, then
:func:`receive_into`) — over NCCL between GPUs, gloo between CPU processes, or a loopback
in one process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from deepinfer_kit._validators import require_ints_at_least
from deepinfer_kit.cache.hybrid_kv import KVStorage
from deepinfer_kit.cache.tiers.disk_store import layout_fingerprint
from deepinfer_kit.cache.tiers.manager import tiered
from deepinfer_kit.cache.tiers.protocols import KVConnectorScheduler, KVConnectorWorker
from deepinfer_kit.components import BuildContext, Factory
from deepinfer_kit.disagg.landing import LandingSlots
from deepinfer_kit.disagg.link import KVLinkReceiver
from deepinfer_kit.disagg.link_connector import DeviceLinkConnector
from deepinfer_kit.disagg.link_sender import LinkSender, LoopbackSender
from deepinfer_kit.disagg.link_worker import DeviceSlotWorker
from deepinfer_kit.engine.engine import Engine
from deepinfer_kit.errors import CapacityError, ConfigError

__all__ = ["link_sender", "link_receiver", "link_to", "link_loopback", "link_connector", "receive_into"]

Pair = tuple[KVConnectorScheduler, KVConnectorWorker]


def _pool(ctx: BuildContext) -> KVStorage:
    pool = ctx.base
    if pool is None or not hasattr(pool, "block_shape"):
        raise ConfigError("a device link is built over the engine's KV pool (components.kv_connector)")
    return pool  # type: ignore[no-any-return]


def _fingerprint(ctx: BuildContext, pool: KVStorage) -> bytes:
    """What a block means: the model (as the tiers name it), its shape and dtype."""
    return layout_fingerprint(f"{ctx.config.model}|{ctx.config.seed}", tuple(pool.block_shape), str(pool.dtype))


def _send_slots(pool: KVStorage, n: int) -> torch.Tensor:
    try:
        return torch.zeros((n, *pool.block_shape), dtype=pool.dtype, device=pool.device)
    except (RuntimeError, MemoryError) as exc:
        raise CapacityError(f"send_slots={n} blocks do not fit on {pool.device}: {exc}") from exc


def _check(hash_key: bytes, *, timeouts: dict[str, float | None] | None = None, **slots: int) -> None:
    """Refuse bad arguments at the call, naming the field and value."""
    if not isinstance(hash_key, bytes) or not 1 <= len(hash_key) <= 64:
        raise ConfigError(f"a device link needs hash_key: 1..64 bytes both sides share, got {hash_key!r}")
    require_ints_at_least(1, **slots)
    for name, value in (timeouts or {}).items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise ConfigError(f"{name} must be a number > 0, got {value!r}")


def link_sender(peer: int, hash_key: bytes, *, group: Any = None, data_group: Any = None, send_slots: int = 64,
                send_all: bool = False, send_timeout_s: float | None = 30.0, source: int = 0) -> Factory[Pair]:
    """The prefill end: a ``components.kv_connector`` sending the prompt blocks of each
    ``save_prompt`` request (every request's with ``send_all``) to rank ``peer`` — the
    bytes over ``data_group`` (NCCL: straight from this GPU's send slots to the peer's
    GPU) or, without one, over ``group`` (gloo, from host memory). ``send_slots``: device
    blocks a send may wait in. ``send_timeout_s``: a send not out by then breaks the link
    (every later block is reported not sent: the decode side computes it). ``source``:
    this engine's number among those sending to one decode engine (its link's id). Hand
    requests over with :func:`~deepinfer_kit.disagg.link.send_request` on the connector's sender
    after ``push_kv_down`` (their blocks are then across).

    Raises:
        ConfigError: no shared ``hash_key``, a bad slot count, timeout or ``peer``.
        CapacityError: (at build) the send slots do not fit on the device.
    """
    _check(hash_key, send_slots=send_slots, timeouts={"send_timeout_s": send_timeout_s})
    require_ints_at_least(0, peer=peer, source=source)

    def build(ctx: BuildContext) -> Pair:
        pool = _pool(ctx)
        slots = _send_slots(pool, send_slots)
        sender = LinkSender(_fingerprint(ctx, pool), peer, group, data_group=data_group, timeout_s=send_timeout_s)
        connector = DeviceLinkConnector(ctx.block_size or 0, hash_key, sender=sender, send_slots=slots,
                                        send_all=send_all, source=source)
        return connector, DeviceSlotWorker(pool, slots, None)

    return Factory(build)


def link_receiver(hash_key: bytes, *, landing_slots: int = 256, timeout_s: float = 5.0,
                  sources: int = 1) -> Factory[Pair]:
    """The decode end: a ``components.kv_connector`` whose ``load_remote`` requests load
    their prompt blocks from ``landing_slots`` device blocks the links fill
    (:func:`receive_into`, one per sender: ``sources`` of them, numbered from 0),
    waiting up to ``timeout_s`` for each they were told of.

    Raises:
        ConfigError: no shared ``hash_key``, a bad slot count or timeout.
        CapacityError: (at build) the landing slots do not fit on the device.
    """
    _check(hash_key, landing_slots=landing_slots, sources=sources, timeouts={"timeout_s": timeout_s})

    def build(ctx: BuildContext) -> Pair:
        pool = _pool(ctx)
        landing = LandingSlots(pool, landing_slots, _fingerprint(ctx, pool))
        landing.open_sources(range(sources))
        connector = DeviceLinkConnector(ctx.block_size or 0, hash_key, landing=landing, timeout_s=timeout_s,
                                        sources=range(sources))
        return connector, DeviceSlotWorker(pool, None, landing.slab)

    return Factory(build)


def link_to(decode: Engine, hash_key: bytes, *, send_slots: int = 64, send_all: bool = False,
            source: int = 0) -> Factory[Pair]:
    """The prefill end for a decode engine in this process (built with
    :func:`link_receiver` and the same ``hash_key``): blocks go straight into its landing
    slots, device to device (another GPU of this host: a peer copy). ``source``: this
    engine's number among the decode engine's ``sources``.

    Raises:
        ConfigError: ``decode`` has no landing slots, another key or no such source, a
            bad slot count; (at build) its blocks mean something else (another model,
            shape or dtype).
    """
    _check(hash_key, send_slots=send_slots)
    require_ints_at_least(0, source=source)
    landing = link_connector(decode).landing
    if landing is None:
        raise ConfigError("link_to needs a decode engine built with link_receiver(...)")
    if link_connector(decode).hash_key != hash_key:
        raise ConfigError("link_to: the decode engine's link has another hash_key")
    if source not in link_connector(decode).accepts.values():
        raise ConfigError(f"link_to: source={source} is not one of the decode engine's link_receiver sources")

    def build(ctx: BuildContext) -> Pair:
        pool = _pool(ctx)
        if _fingerprint(ctx, pool) != landing.fingerprint:
            raise ConfigError("link_to: the decode engine's blocks are of another model, shape or dtype")
        slots = _send_slots(pool, send_slots)
        connector = DeviceLinkConnector(ctx.block_size or 0, hash_key, sender=LoopbackSender(landing),
                                        send_slots=slots, send_all=send_all, source=source)
        return connector, DeviceSlotWorker(pool, slots, None)

    return Factory(build)


def link_loopback(hash_key: bytes, *, send_slots: int = 64, landing_slots: int = 256,
                  send_all: bool = True) -> Factory[Pair]:
    """Both ends over one pool in one process: published prompt blocks go, device to
    device, into landing slots the same engine loads from (a device-resident tier below
    the pool; the conformance suite's round trip).

    Raises:
        ConfigError: no ``hash_key``, a bad slot count.
    """
    _check(hash_key, send_slots=send_slots, landing_slots=landing_slots)

    def build(ctx: BuildContext) -> Pair:
        pool = _pool(ctx)
        landing = LandingSlots(pool, landing_slots, _fingerprint(ctx, pool))
        slots = _send_slots(pool, send_slots)
        connector = DeviceLinkConnector(ctx.block_size or 0, hash_key, sender=LoopbackSender(landing),
                                        send_slots=slots, landing=landing, send_all=send_all)
        return connector, DeviceSlotWorker(pool, slots, landing.slab)

    return Factory(build)


def link_connector(engine: Engine) -> DeviceLinkConnector:
    """``engine``'s device link connector.

    Raises:
        ConfigError: the engine was not built with one.
    """
    cache = tiered(engine.cache)
    connector = cache.connector if cache is not None else None
    if not isinstance(connector, DeviceLinkConnector):
        raise ConfigError("the engine has no device link: build it with components.kv_connector=link_sender(...) "
                          "or link_receiver(...)")
    return connector


def receive_into(engine: Engine, on_request: Callable[[str, list[int], Any], None], peer: int, *,
                 group: Any = None, data_group: Any = None, source: int = 0) -> KVLinkReceiver:
    """Start receiving from rank ``peer`` into ``engine``'s landing slots (an engine built
    with :func:`link_receiver`); requests go to ``on_request``. ``data_group`` must match
    the sender's (NCCL: the blocks land on the engine's GPU without a host copy);
    ``source``: that sender's number (its ``link_sender(source=...)``).

    Raises:
        ConfigError: the engine has no landing slots.
    """
    landing = link_connector(engine).landing
    if landing is None:
        raise ConfigError("receive_into needs an engine built with link_receiver(...): it has no landing slots")
    return KVLinkReceiver(landing, on_request, peer, group, data_group=data_group, device=landing.slab.device,
                          source=source)
