"""sim_tiers: the KV tiers' scheduler side for a simulation — the engine's own decisions
over counted slots and keys."""

from __future__ import annotations

from deepinfer_kit.cache.tiers.bytes import KeysOnlyStore, NoBytes
from deepinfer_kit.cache.tiers.disk_tier import DiskTier
from deepinfer_kit.cache.tiers.offload import OffloadConnector
from deepinfer_kit.engine.config import EngineConfig

__all__ = ["sim_tiers"]


def sim_tiers(config: EngineConfig, block_size: int) -> OffloadConnector | None:
    """The scheduler side of ``config.kv_tiers`` for a simulation: the engine's
    :class:`OffloadConnector` (same admission, eviction, write policy and prefetch rules)
    over a host tier of counted slots and a disk tier of keys, its I/O run inline. Pure
    bookkeeping: no torch, no files (``disk_path`` is not touched). None without tiers."""
    tiers = config.kv_tiers
    if tiers is None:
        return None
    disk = None
    if tiers.disk_blocks:
        disk = DiskTier(KeysOnlyStore(), tiers.disk_blocks, tiers.disk_eviction, 0, NoBytes().new_block)
    return OffloadConnector(tiers, NoBytes(), disk, block_size)
