"""TierConfig and KVRequestParams: how the KV tiers below the device are sized and used,
engine-wide and per request (no torch: the simulator reads them)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from deepinfer_kit._validators import config_from, int_at_least, one_of
from deepinfer_kit.errors import ConfigError

__all__ = ["TierConfig", "KVRequestParams", "WRITE_POLICIES", "PREFETCH_POLICIES"]

WRITE_POLICIES = ("write_through", "write_back")
PREFETCH_POLICIES = ("wait", "best_effort")
_EVICTION = ("lru", "frequency")
_ADMISSION = ("all", "seen_twice")


def _seconds(instance: object, attribute: attrs.Attribute[float], value: object) -> None:
    """A finite number of seconds >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ConfigError(f"{attribute.name} must be a finite number of seconds >= 0, got {value!r}")


def _flag(instance: object, attribute: attrs.Attribute[bool], value: object) -> None:
    """True or False (a ConfigError naming the field otherwise)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{attribute.name} must be True or False, got {value!r}")


def _key(instance: object, attribute: attrs.Attribute[bytes | None], value: object) -> None:
    """``None`` or 16..64 bytes."""
    if value is not None and (not isinstance(value, bytes) or not 16 <= len(value) <= 64):
        raise ConfigError(f"{attribute.name} must be None or 16 to 64 bytes, got {value!r}")


@attrs.frozen(slots=True)
class TierConfig:
    """The KV tiers under the device pool (docs/kv_tiers.md).

    A block published on the device (its KV written and committed) may be copied to a
    **host** tier (pinned memory on CUDA, plain memory on CPU) and from there to a
    **disk** tier (one file per block, checksummed, read through a memory map). A request
    whose prefix misses the device but hits a lower tier loads those blocks into fresh
    device blocks before its first chunk instead of recomputing them. Every tier is a
    cache: a block lost or corrupt in one is recomputed, never an error.

    Attributes:
        host_blocks: capacity of the host tier in blocks (each holds every layer's K/V of
            ``block_size`` tokens, as a device block does); 0 for none.
        disk_blocks: capacity of the disk tier in blocks; 0 for none.
        disk_path: the disk tier's folder (created; files ``<key>.kvb``). Required when
            ``disk_blocks > 0``. Two engines that share a folder and a ``hash_key`` read
            each other's blocks (prefill/decode disaggregation on one host).
        write_policy: ``"write_through"``: a block is saved to the host tier when it is
            published, and to disk once its host copy is written; ``"write_back"``: a
            block moves down a tier only when it is evicted from the one above.
        admission: which blocks a tier takes: ``"all"``, or ``"seen_twice"`` (a block
            goes down only the second time its key is published or evicted within the
            last ``admission_window`` keys seen: one-off prompts never reach the tiers).
        admission_window: keys remembered by ``"seen_twice"``.
        host_eviction, disk_eviction: ``"lru"`` or ``"frequency"`` (least frequently
            used, ties least recent, counts halved every ``capacity`` uses: a burst of
            one-off blocks cannot flush a hot system prompt).
        prefetch: reading disk blocks starts when a request arrives; at admission
            ``"wait"`` waits for the reads up to ``prefetch_timeout_s`` after arrival,
            ``"best_effort"`` takes what has landed. A block not read in time is
            recomputed; the request never fails for it.
        prefetch_timeout_s: see ``prefetch``; also bounds the wait for a block another
            engine is still writing (``KVRequestParams.load_remote``).
        hash_key: the BLAKE2b key of block identities (16..64 bytes), shared by engines
            that share a disk folder; ``None``: a random key per engine.
        io_threads: threads reading and writing the disk tier.
        layerwise_loads: a round's loads into the device are copied layer by layer beside
            its forward, which waits for each layer's copy just before that layer (a
            stream of their own on CUDA, a thread on the CPU); ``False``: every load is
            done, or ordered on the forward's stream, before the forward starts. The
            tokens are the same either way.
    """

    host_blocks: int = attrs.field(default=0, validator=int_at_least(0))
    disk_blocks: int = attrs.field(default=0, validator=int_at_least(0))
    disk_path: str | None = attrs.field(default=None)
    write_policy: str = attrs.field(default="write_through", validator=one_of(WRITE_POLICIES))
    admission: str = attrs.field(default="all", validator=one_of(_ADMISSION))
    admission_window: int = attrs.field(default=65536, validator=int_at_least(1))
    host_eviction: str = attrs.field(default="lru", validator=one_of(_EVICTION))
    disk_eviction: str = attrs.field(default="lru", validator=one_of(_EVICTION))
    prefetch: str = attrs.field(default="wait", validator=one_of(PREFETCH_POLICIES))
    prefetch_timeout_s: float = attrs.field(default=5.0, validator=_seconds)
    hash_key: bytes | None = attrs.field(default=None, validator=_key)
    io_threads: int = attrs.field(default=2, validator=int_at_least(1))
    layerwise_loads: bool = attrs.field(default=True, validator=_flag)

    def __attrs_post_init__(self) -> None:
        if self.disk_blocks and not self.disk_path:
            raise ConfigError(f"disk_blocks={self.disk_blocks} needs a disk_path, got {self.disk_path!r}")
        if self.disk_path is not None and not isinstance(self.disk_path, str):
            raise ConfigError(f"disk_path must be a str or None, got {self.disk_path!r}")
        if not self.host_blocks and (self.disk_blocks or self.disk_path):
            raise ConfigError(
                f"a disk tier reads and writes through the host tier: host_blocks must be > 0, got "
                f"{self.host_blocks}")

    @classmethod
    def coerce(cls, value: TierConfig | Mapping[str, Any] | None) -> TierConfig | None:
        """A :class:`TierConfig` from itself, ``None`` or a dict of its fields.

        A ``hash_key`` given as a string is read as hex (a JSON config's form).

        Raises:
            ConfigError: another type, an unknown key, or a bad value (naming the field).
        """
        if isinstance(value, Mapping) and isinstance(value.get("hash_key"), str):
            try:
                value = {**value, "hash_key": bytes.fromhex(value["hash_key"])}
            except ValueError:
                raise ConfigError(f"kv_tiers.hash_key as a string must be hex, got {value['hash_key']!r}") from None
        return config_from(cls, value, "kv_tiers")


def is_link_id(value: object) -> bool:
    """Whether ``value`` can name a device link: 1..64 lowercase hex digits. Pure."""
    return isinstance(value, str) and 0 < len(value) <= 64 and all(c in "0123456789abcdef" for c in value)


def _link_id(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A link id (:func:`is_link_id`)."""
    if not is_link_id(value):
        raise ConfigError(f"{attribute.name} must be 1..64 lowercase hex digits, got {value!r}")


@attrs.frozen(slots=True)
class KVRequestParams:
    """What one request does with the KV tiers (``Engine.add_request(kv=...)``).

    Attributes:
        write: ``False`` opts the request out of tier writes: its blocks are never saved
            below the device (a prompt that must not outlive its request on disk). It
            still reads what other requests saved.
        save_prompt: save every full block of the prompt to every tier as soon as it is
            computed, whatever the admission policy (the prefill side of
            prefill/decode disaggregation).
        load_remote: the prompt's blocks are being written to the shared disk folder by
            another engine: wait for each (up to ``TierConfig.prefetch_timeout_s``) instead
            of taking only what is there (the decode side).
        remote_blocks: with ``load_remote``, how many leading prompt blocks the other
            engine wrote (its answer's ``kv_transfer_params``): only those are waited
            for, the rest computed at once. ``None``: wait for every prompt block.
        remote_link: with ``load_remote`` over a device link, the link the blocks were
            sent on (a prefill server's answer names it): an engine on another link
            waits for none of them (a proxy that paired servers not linked costs a
            recompute, not a stall). ``None``: not said. Ignored by the disk tiers.
    """

    write: bool = attrs.field(default=True, validator=_flag)
    save_prompt: bool = attrs.field(default=False, validator=_flag)
    load_remote: bool = attrs.field(default=False, validator=_flag)
    remote_blocks: int | None = attrs.field(default=None, validator=attrs.validators.optional(int_at_least(0)))
    remote_link: str | None = attrs.field(default=None, validator=attrs.validators.optional(_link_id))

    def __attrs_post_init__(self) -> None:
        if self.save_prompt and not self.write:
            raise ConfigError("save_prompt=True with write=False: a request cannot both save and opt out")

    @classmethod
    def coerce(cls, value: KVRequestParams | Mapping[str, Any] | None) -> KVRequestParams | None:
        """A :class:`KVRequestParams` from itself, ``None`` or a dict of its fields.

        Raises:
            ConfigError: another type, an unknown key, or a bad value (naming the field).
        """
        return config_from(cls, value, "kv")
