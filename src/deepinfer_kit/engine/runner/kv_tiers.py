"""attach_kv_tiers: the KV tiers of an EngineConfig over a built runner's pool."""

from __future__ import annotations

from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.cache.tiers.build import build_tiers
from deepinfer_kit.cache.tiers.protocols import KVConnectorScheduler
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.engine.runner.model_runner import ModelRunner
from deepinfer_kit.engine.runner.speculative import ServingRunner, SpeculativeRunner
from deepinfer_kit.errors import ConfigError

__all__ = ["attach_kv_tiers"]


def attach_kv_tiers(config: EngineConfig, runner: ServingRunner) -> KVConnectorScheduler | None:
    """The KV tiers of ``config`` over the runner's pool: the device side goes to the plain
    runner (``ModelRunner.kv_transfer``), the scheduler side is returned for the cache
    manager (None without tiers). Called once, by ``build_engine``, in the process that
    holds the pool.

    Raises:
        ConfigError: a pool with sliding-window groups, or a disk folder that cannot be
            created.
    """
    if config.kv_tiers is None:
        return None
    plain = runner.runner if isinstance(runner, SpeculativeRunner) else runner
    assert isinstance(plain, ModelRunner)
    if not isinstance(plain.kv_cache, PagedKVCache):
        raise ConfigError("kv_tiers with a sliding-window model (hybrid_kv_cache=True) is not built yet: "
                          "set hybrid_kv_cache=False or kv_tiers=None")
    connector, worker = build_tiers(config.kv_tiers, plain.kv_cache, model=f"{config.model}|{config.seed}")
    plain.kv_transfer = worker
    return connector
