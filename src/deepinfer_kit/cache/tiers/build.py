"""build_tiers: the host and disk tiers of a TierConfig over one device pool — the
connector's two sides, sharing the host slab."""

from __future__ import annotations

from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.cache.tiers.config import TierConfig
from deepinfer_kit.cache.tiers.disk_store import DiskBlockStore, layout_fingerprint
from deepinfer_kit.cache.tiers.disk_tier import DiskTier
from deepinfer_kit.cache.tiers.host_worker import HostTransferWorker, SlabBytes, host_slab
from deepinfer_kit.cache.tiers.offload import OffloadConnector

__all__ = ["build_tiers"]


def build_tiers(config: TierConfig, kv_cache: PagedKVCache, *, model: str = "") -> tuple[OffloadConnector, HostTransferWorker]:
    """The scheduler side and the device side of ``config``'s tiers over ``kv_cache``.

    Called once per engine build, in the process that holds the pool. Allocates the host
    slab (``host_blocks`` blocks of the pool's shape and dtype; pinned on CUDA) and, with
    a disk tier, creates its folder. ``model`` names what the K/V mean (the checkpoint):
    part of the disk files' fingerprint with the block shape and dtype, so two engines
    sharing a folder read each other's blocks only when they compute the same K/V.

    Raises:
        ConfigError: the disk folder cannot be created.
    """
    slab = host_slab(kv_cache, config.host_blocks)
    host = SlabBytes(slab)
    disk = None
    if config.disk_blocks:
        assert config.disk_path is not None  # TierConfig checked it
        fp = layout_fingerprint(model, kv_cache.block_shape, str(kv_cache.dtype))
        disk = DiskTier(DiskBlockStore(config.disk_path, fp), config.disk_blocks, config.disk_eviction,
                        config.io_threads, host.new_block)
    connector = OffloadConnector(config, host, disk, kv_cache.block_size)
    return connector, HostTransferWorker(kv_cache, slab)
