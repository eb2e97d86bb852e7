"""attach_kv_tiers: the KV tiers of an EngineConfig over a built runner's pool."""

from __future__ import annotations

import time

from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.cache.tiers.build import build_tiers
from deepinfer_kit.cache.tiers.protocols import KVConnectorScheduler
from deepinfer_kit.components import BuildContext, Components
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.engine.runner.model_runner import ModelRunner
from deepinfer_kit.engine.runner.speculative import ServingRunner, SpeculativeRunner
from deepinfer_kit.errors import ConfigError

__all__ = ["attach_kv_tiers"]


def attach_kv_tiers(config: EngineConfig, runner: ServingRunner,
                    components: Components | None = None) -> KVConnectorScheduler | None:
    """The KV connector over the runner's pool — ``components.kv_connector``'s when given,
    else the tiers ``config.kv_tiers`` names: its device side goes to the plain runner
    (``ModelRunner.kv_transfer``), its scheduler side is returned for the cache manager
    (None when there is neither). Called once, by ``build_engine``, in the process that
    holds the pool.

    Raises:
        ConfigError: a pool with sliding-window groups, a worker process or several ranks
            (``EngineConfig.check_kv_transfer``), or a disk folder that cannot be created.
    """
    factory = components.kv_connector if components is not None else None
    if config.kv_tiers is None and factory is None:
        return None
    config.check_kv_transfer()
    plain = runner.runner if isinstance(runner, SpeculativeRunner) else runner
    assert isinstance(plain, ModelRunner)
    if not isinstance(plain.kv_cache, PagedKVCache):
        raise ConfigError("a KV connector with a sliding-window model (hybrid_kv_cache=True) is not built "
                          "yet: set hybrid_kv_cache=False, or neither kv_tiers nor components.kv_connector")
    if factory is not None:
        ctx = BuildContext(config=config, clock=time.monotonic, block_size=config.block_size,
                           num_blocks=plain.kv_cache.num_blocks, device=str(plain.kv_cache.device),
                           base=plain.kv_cache)
        connector, worker = factory(ctx)
    else:
        assert config.kv_tiers is not None
        connector, worker = build_tiers(config.kv_tiers, plain.kv_cache, model=f"{config.model}|{config.seed}")
    plain.kv_transfer = worker
    return connector
