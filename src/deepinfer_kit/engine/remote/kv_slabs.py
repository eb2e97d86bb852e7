"""remote_kv_tiers: the scheduler side of an engine's KV tiers over the host slabs its
worker processes hold, mapped here from shared memory."""

from __future__ import annotations

import os
from collections.abc import Sequence

from deepinfer_kit.cache.tiers.build import host_side_tiers
from deepinfer_kit.cache.tiers.offload import OffloadConnector
from deepinfer_kit.cache.tiers.records import TransferOutput, TransferPlan, merge_outputs
from deepinfer_kit.cache.tiers.shared_slab import map_host_slab
from deepinfer_kit.cache.tiers.slab_bytes import RankSlabs
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.engine.remote.process_group import ProcessGroupRunner
from deepinfer_kit.engine.remote.process_runner import ProcessRunner
from deepinfer_kit.errors import InvariantError

__all__ = ["remote_kv_tiers", "RemoteKVTransfer"]


def remote_kv_tiers(config: EngineConfig, runner: ProcessRunner | ProcessGroupRunner) -> OffloadConnector | None:
    """The tiers' scheduler side for ``config.kv_tiers`` (None without) over the slab of
    every rank of ``runner`` (each rank's device side copies its key/value heads into its
    own; :class:`RankSlabs` sees whole blocks). Called once, by ``build_engine``, after
    the workers reported ready; closes the descriptors it mapped, and sets
    ``runner.kv_transfer`` (:class:`RemoteKVTransfer`) for transfers outside rounds.

    Raises:
        ConfigError: the disk folder cannot be created.
        InvariantError: a worker reported no slab.
    """
    ranks = runner.ranks if isinstance(runner, ProcessGroupRunner) else [runner]
    if config.kv_tiers is None:
        return None
    slabs, starts, total = [], [], 0
    try:
        for i, rank in enumerate(ranks):
            shard, fd = rank.info.kv_slab, rank.kv_slab_fd
            if shard is None or fd is None:
                raise InvariantError(f"worker rank {i} built no host KV slab for kv_tiers")
            slabs.append(map_host_slab(fd, shard))
            starts.append(shard.kv_start)
            total = shard.total_heads
    finally:
        for rank in ranks:
            if rank.kv_slab_fd is not None:
                os.close(rank.kv_slab_fd)
                rank.kv_slab_fd = None
    connector = host_side_tiers(config.kv_tiers, RankSlabs(slabs, starts, total), block_size=config.block_size,
                                model=f"{config.model}|{config.seed}")
    runner.kv_transfer = RemoteKVTransfer(ranks)
    return connector


class RemoteKVTransfer:
    """The KV tiers' device side in worker processes, for transfers outside any round
    (``TieredKVCacheManager.transfer_idle``: the prefill side of disaggregation pushing
    its last blocks down): a :class:`~deepinfer_kit.cache.tiers.protocols.KVConnectorWorker`
    that collects the saves and loads, then at :meth:`wait_for_load` has every rank run
    them (after the steps sent before) and merges the ranks' reports
    (:func:`~deepinfer_kit.cache.tiers.records.merge_outputs`). A round's own transfers
    travel in its plan, not through here.

    Args:
        ranks: the workers, rank 0 first.
    """

    def __init__(self, ranks: Sequence[ProcessRunner]) -> None:
        self._ranks = list(ranks)
        self._plan = TransferPlan()
        self._report: TransferOutput | None = None
        self._ran = False  # a plan ran on the ranks since the last get_finished

    def start_save_kv(self, plan: TransferPlan) -> None:
        """Queue ``plan.saves`` and their windows (run at :meth:`wait_for_load`)."""
        self._plan.saves.extend(plan.saves)
        for g, own in plan.save_groups.items():
            self._plan.save_groups.setdefault(g, []).extend(own)

    def start_load_kv(self, plan: TransferPlan) -> None:
        """Queue ``plan.loads`` and their windows (run at :meth:`wait_for_load`)."""
        self._plan.loads.extend(plan.loads)
        for g, own in plan.load_groups.items():
            self._plan.load_groups.setdefault(g, []).extend(own)

    def wait_for_load(self) -> None:
        """Have every rank run the queued copies; returns when all have.

        Raises:
            EngineDeadError: a worker is gone.
            Exception: what a rank's device side raised.
        """
        plan, self._plan = self._plan, TransferPlan()
        if plan:
            self._run(plan)

    def _run(self, plan: TransferPlan) -> None:
        """Every rank runs ``plan`` (possibly empty) and reports; the reports merge."""
        self._ran = True
        for rank in self._ranks:  # all receive it before any is awaited
            rank.send_control(("kv_transfer", rank.released, plan))
        answers = [rank.answer() for rank in self._ranks]
        for answer in answers:
            if isinstance(answer, BaseException):
                raise answer
        merged = merge_outputs([a if isinstance(a, TransferOutput) else None for a in answers])
        if merged is not None and self._report is not None:  # two runs since the last report
            self._report.saved.extend(merged.saved)
            self._report.failed_saves.extend(merged.failed_saves)
            self._report.failed_loads.extend(merged.failed_loads)
        elif merged is not None:
            self._report = merged

    def get_finished(self) -> TransferOutput | None:
        """What the ranks reported since the last call (merged); None when they have
        nothing to report. With nothing run since the last call, asks them anyway (a
        failed round's saves that ran are reported by the next report)."""
        if not self._ran:
            self._run(TransferPlan())
        report, self._report, self._ran = self._report, None, False
        return report
