"""attach_kv_tiers: the KV tiers of an EngineConfig over a built runner's pool — both
sides in the engine's process, or (:func:`attach_worker_slab`) the device side in a worker
process over a host slab in shared memory, whose scheduler side the host builds."""

from __future__ import annotations

import time

from deepinfer_kit.cache.hybrid_kv import KVStorage
from deepinfer_kit.cache.tiers.build import build_tiers
from deepinfer_kit.cache.tiers.host_worker import HostTransferWorker
from deepinfer_kit.cache.tiers.protocols import KVConnectorScheduler
from deepinfer_kit.cache.tiers.rank_agreement import launched_tiers
from deepinfer_kit.cache.tiers.shared_slab import SlabShard, shared_host_slab
from deepinfer_kit.comm.world import ParallelGroups
from deepinfer_kit.components import BuildContext, Components
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.engine.runner.model_runner import ModelRunner
from deepinfer_kit.engine.runner.speculative import ServingRunner, SpeculativeRunner
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.config import ModelConfig
from deepinfer_kit.models.parallel.shard import attention_shard

__all__ = ["attach_kv_tiers", "attach_worker_slab", "kv_heads_of_rank"]


def attach_kv_tiers(config: EngineConfig, runner: ServingRunner, components: Components | None = None, *,
                    model: ModelConfig | None = None,
                    groups: ParallelGroups | None = None) -> KVConnectorScheduler | None:
    """The KV connector over the runner's pool — ``components.kv_connector``'s when given,
    else the tiers ``config.kv_tiers`` names: its device side goes to the plain runner
    (``ModelRunner.kv_transfer``), its scheduler side is returned for the cache manager
    (None when there is neither). Called once, by ``build_engine``, in the process that
    holds the pool (``worker="inline"``, or each ``"launched"`` rank: ``groups`` and
    ``model`` given, the tiers hold this rank's heads and agree with the other ranks,
    :mod:`~deepinfer_kit.cache.tiers.rank_agreement`; a collective there).

    Raises:
        ConfigError: prefix caching off, an injected connector on launched ranks, or a
            disk folder that cannot be created.
        CapacityError: the host cannot allocate the host tier.
    """
    factory = components.kv_connector if components is not None else None
    if config.kv_tiers is None and factory is None:
        return None
    config.check_kv_transfer()
    plain, pool = _runner_and_kv(runner)
    if groups is not None and model is not None:
        if factory is not None:
            raise ConfigError("components.kv_connector on worker='launched' ranks is not built (the ranks' "
                              "tiers must agree on what they load): use kv_tiers")
        assert config.kv_tiers is not None
        start, total = kv_heads_of_rank(model, groups)
        tiers, plain.kv_transfer = launched_tiers(config.kv_tiers, pool, start, total,
                                                  model=f"{config.model}|{config.seed}")
        return tiers
    connector: KVConnectorScheduler
    if factory is not None:
        ctx = BuildContext(config=config, clock=time.monotonic, block_size=config.block_size,
                           num_blocks=pool.num_blocks, device=str(pool.device), base=pool)
        connector, worker = factory(ctx)
    else:
        assert config.kv_tiers is not None
        connector, worker = build_tiers(config.kv_tiers, pool, model=f"{config.model}|{config.seed}")
    plain.kv_transfer = worker
    return connector


def attach_worker_slab(config: EngineConfig, runner: ServingRunner, model: ModelConfig,
                       groups: ParallelGroups | None) -> tuple[SlabShard, int] | None:
    """In a worker process: this rank's host tier slab, in shared memory, and the device
    side copying into it (``ModelRunner.kv_transfer``); returns the slab's
    :class:`SlabShard` and the descriptor the host maps it by (None without
    ``config.kv_tiers``). Called once, after ``build_device``.

    Raises:
        CapacityError: the host cannot reserve the slab.
    """
    if config.kv_tiers is None:
        return None
    plain, pool = _runner_and_kv(runner)
    start, total = kv_heads_of_rank(model, groups)
    slab, fd, shard = shared_host_slab(pool, config.kv_tiers.host_blocks, start, total)
    plain.kv_transfer = HostTransferWorker(pool, slab, layerwise=config.kv_tiers.layerwise_loads)
    return shard, fd


def kv_heads_of_rank(model: ModelConfig, groups: ParallelGroups | None) -> tuple[int, int]:
    """``(first head, heads of the model)`` of the key/value heads this rank's pool holds
    (``models.parallel.shard.attention_shard``; a latent row (MLA) is one head every rank
    holds)."""
    if model.mla is not None:
        return 0, 1
    tp = groups.tp if groups is not None else None
    if tp is None or tp.world_size == 1:
        return 0, model.num_kv_heads
    return attention_shard(model, tp.world_size, tp.rank).kv_start, model.num_kv_heads


def _runner_and_kv(runner: ServingRunner) -> tuple[ModelRunner, KVStorage]:
    """The plain runner under ``runner`` and the K/V the tiers copy: its one
    :class:`PagedKVCache`, or a hybrid cache's pools (every layer: the full-attention
    group's blocks and the sliding groups' windows of them)."""
    plain = runner.runner if isinstance(runner, SpeculativeRunner) else runner
    assert isinstance(plain, ModelRunner)
    return plain, plain.kv_cache
