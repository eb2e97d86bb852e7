"""build_tiers: the host and disk tiers of a TierConfig over one device pool — the
connector's two sides, sharing the host slab; and the scheduler side alone over slabs
that worker processes hold (:func:`host_side_tiers`)."""

from __future__ import annotations

import os
from collections.abc import Callable

from deepinfer_kit.cache.hybrid_kv import KVStorage
from deepinfer_kit.cache.tiers.config import TierConfig
from deepinfer_kit.cache.tiers.disk_store import DiskBlockStore, layout_fingerprint
from deepinfer_kit.cache.tiers.disk_tier import DiskTier
from deepinfer_kit.cache.tiers.host_worker import HostTransferWorker, host_slab
from deepinfer_kit.cache.tiers.offload import OffloadConnector
from deepinfer_kit.cache.tiers.slab_bytes import RankSlabs

__all__ = ["build_tiers", "host_side_tiers"]


def build_tiers(config: TierConfig, kv_cache: KVStorage, *, model: str = "") -> tuple[OffloadConnector, HostTransferWorker]:
    """The scheduler side and the device side of ``config``'s tiers over ``kv_cache``.

    Called once per engine build, in the process that holds the pool. Allocates the host
    slab (``host_blocks`` blocks of the pool's shape and dtype; pinned on CUDA) and, with
    a disk tier, creates its folder. ``model`` names what the K/V mean (the checkpoint):
    part of the disk files' fingerprint with the block shape and dtype, so two engines
    sharing a folder read each other's blocks only when they compute the same K/V.

    Raises:
        ConfigError: the disk folder cannot be created.
        CapacityError: the host cannot allocate the slab.
    """
    slab = host_slab(kv_cache, config.host_blocks)
    connector = host_side_tiers(config, RankSlabs([slab], [0], kv_cache.num_kv_heads), block_size=kv_cache.block_size,
                                model=model)
    return connector, HostTransferWorker(kv_cache, slab, layerwise=config.layerwise_loads)


def host_side_tiers(config: TierConfig, slabs: RankSlabs, *, block_size: int, model: str = "",
                    agree: Callable[[int], int] | None = None) -> OffloadConnector:
    """The scheduler side of ``config``'s tiers over host slabs the device side fills
    (this process's, or worker processes' mapped here). The disk files hold whole blocks
    (:class:`RankSlabs`): their fingerprint names ``model``, the whole block's shape and
    the dtype, not the ranks' split. Slabs of a run of heads short of the model's (one
    ``worker="launched"`` rank's) write files of those heads, in a folder of their own
    under ``disk_path`` and with the heads in the fingerprint. ``agree``: see
    :class:`OffloadConnector`.

    Raises:
        ConfigError: the disk folder cannot be created.
    """
    disk = None
    if config.disk_blocks:
        assert config.disk_path is not None  # TierConfig checked it
        path = config.disk_path
        lo, hi, total = slabs.heads
        if (lo, hi) != (0, total):  # a run of heads (one launched rank's): files of their own
            model = f"{model}|heads {lo}:{hi} of {total}"
            path = os.path.join(path, f"heads-{lo}-{hi}-of-{total}")
        fp = layout_fingerprint(model, slabs.block_shape, str(slabs.dtype))
        disk = DiskTier(DiskBlockStore(path, fp), config.disk_blocks, config.disk_eviction,
                        config.io_threads, slabs.new_block)
    return OffloadConnector(config, slabs, disk, block_size, agree=agree)
