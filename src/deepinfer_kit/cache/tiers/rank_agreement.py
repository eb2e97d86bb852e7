"""The KV tiers on ranks that each run the whole engine (``worker="launched"``): every rank
must make the same scheduling decisions, so what a rank's own tiers can do is agreed with
the others — how many tier blocks a request loads (the fewest any rank holds), and which
loads failed (any rank's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from deepinfer_kit.cache.hybrid_kv import KVStorage
from deepinfer_kit.cache.tiers.build import host_side_tiers
from deepinfer_kit.cache.tiers.config import TierConfig
from deepinfer_kit.cache.tiers.host_worker import HostTransferWorker, host_slab
from deepinfer_kit.cache.tiers.offload import OffloadConnector
from deepinfer_kit.cache.tiers.protocols import LayerwiseKVConnectorWorker
from deepinfer_kit.cache.tiers.records import TransferOutput, TransferPlan
from deepinfer_kit.cache.tiers.slab_bytes import RankSlabs

__all__ = ["world_min", "AgreedLoads", "launched_tiers"]


def world_min(group: Any) -> Callable[[int], int]:
    """``agree`` for :class:`~deepinfer_kit.cache.tiers.offload.OffloadConnector`: the
    smallest of every rank's count (an all-reduce over ``group``, a gloo group). Every
    rank calls it at the same point of its schedule (they schedule alike)."""

    def agree(count: int) -> int:
        t = torch.tensor([count], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        return int(t.item())

    return agree


class AgreedLoads:
    """A :class:`KVConnectorWorker` whose reports name the loads that failed on any rank of
    ``group`` (a gloo group): a rank whose load failed computed garbage every rank then
    shares, so every rank must end the requests that read it. One small all-reduce per
    report, a gather only when some rank has a failed load. Saves stay each rank's own
    (each rank's tiers hold its own heads).

    Args:
        inner: this rank's device side (the host tier's).
        group: the ranks that schedule alike.
    """

    def __init__(self, inner: HostTransferWorker, group: Any) -> None:
        self.inner = inner
        self.group = group

    def start_save_kv(self, plan: TransferPlan) -> None:
        """As the inner worker."""
        self.inner.start_save_kv(plan)

    def start_load_kv(self, plan: TransferPlan) -> None:
        """As the inner worker."""
        self.inner.start_load_kv(plan)

    def wait_for_layer_load(self, layer: int) -> None:
        """As the inner worker (each rank's loads are its own)."""
        self.inner.wait_for_layer_load(layer)

    def wait_for_load(self) -> None:
        """As the inner worker."""
        self.inner.wait_for_load()

    def close(self) -> None:
        """As the inner worker."""
        self.inner.close()

    def get_finished(self) -> TransferOutput | None:
        """The inner report, its failed loads those of every rank. Collective: every rank
        calls it once per round (and per idle transfer)."""
        out = self.inner.get_finished()
        mine = list(out.failed_loads) if out is not None else []
        flag = torch.tensor([len(mine)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if not int(flag.item()):
            return out
        gathered: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, mine, group=self.group)
        failed = sorted({b for rank in gathered for b in rank})
        out = out if out is not None else TransferOutput()
        out.failed_loads = failed
        return out


def launched_tiers(tiers: TierConfig, pool: KVStorage, start: int, total: int, *,
                   model: str = "") -> tuple[OffloadConnector, AgreedLoads]:
    """One launched rank's tiers over its pool, which holds key/value heads ``start ..``
    of ``total``: a host slab of those heads, disk files of its own (in a folder per run of
    heads, :func:`~deepinfer_kit.cache.tiers.build.host_side_tiers`), and the agreement
    with every other rank over a gloo group made here. Collective: every rank of the
    world calls it, in the same order, at build.

    Raises:
        ConfigError: the disk folder cannot be created.
        CapacityError: the host cannot allocate the slab.
    """
    slab = host_slab(pool, tiers.host_blocks)
    group = dist.new_group(backend="gloo")
    connector = host_side_tiers(tiers, RankSlabs([slab], [start], total, partial=True), block_size=pool.block_size,
                                model=model, agree=world_min(group))
    return connector, AgreedLoads(HostTransferWorker(pool, slab, layerwise=tiers.layerwise_loads), group)


if TYPE_CHECKING:
    _check: type[LayerwiseKVConnectorWorker] = AgreedLoads
