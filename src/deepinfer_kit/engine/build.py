"""build_engine: the one place that constructs the default components from an EngineConfig."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TYPE_CHECKING

import attrs

from deepinfer_kit.components import BuildContext, Components, build
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.engine.engine import Engine
from deepinfer_kit.engine.host import build_host_components
from deepinfer_kit.engine.remote.kv_slabs import remote_kv_tiers
from deepinfer_kit.engine.remote.start import start_workers
from deepinfer_kit.overlap.choose import default_executor
from deepinfer_kit.engine.remote.rank_groups import launched_groups
from deepinfer_kit.engine.runner.build import build_device
from deepinfer_kit.engine.runner.kv_tiers import attach_kv_tiers
from deepinfer_kit.engine.runner.pool import engine_device
from deepinfer_kit.engine.runner.drafters import check_speculative
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.tokenizer import (
    ByteTokenizer, Tokenizer, load_tokenizer, missing_tokenizer_reason,
)

if TYPE_CHECKING:
    from deepinfer_kit.comm.protocols import Communicator
    from deepinfer_kit.engine.protocols import Balancer, StepRunner
    from deepinfer_kit.engine.runner.speculative import ServingRunner
    from deepinfer_kit.models.config import ModelConfig
    from deepinfer_kit.overlap.protocols import OverlapExecutor
    from deepinfer_kit.engine.trace import StepTrace
    from deepinfer_kit.sched.protocols import Scheduler
    from deepinfer_kit.cache.protocols import KVCacheManager
    from deepinfer_kit.cache.tiers.protocols import KVConnectorScheduler

__all__ = ["build_engine", "check_components", "load_host_tokenizer"]


def build_engine(
    config: EngineConfig | None = None,
    *,
    components: Components | None = None,
    trace: Callable[[StepTrace], None] | None = None,
    worker_setup: Callable[[ServingRunner], object] | None = None,
    wrap_comm: Callable[[Communicator], Communicator] | None = None,
    **overrides: Any,
) -> Engine:
    """Load the model and build every component of ``config`` — the one place the engine's
    concrete parts are assembled.

    ``overrides`` replace config fields (``build_engine(num_blocks=64)``). ``components``
    (:class:`~deepinfer_kit.components.Components`) replaces any built-in component
    by one of yours, an instance or a :class:`~deepinfer_kit.components.Factory`
    built where it runs: host components here, device components beside the model (in
    each worker process with ``worker="process"``, where they must be factories of
    module-level callables or instances that pickle; checked before any process starts).
    ``trace`` is called with each step's :class:`StepTrace`.

    With ``worker="process"`` the model, KV pool and sampler are built in a worker process
    (:class:`ProcessRunner`) and ``worker_setup``, when given, is called there with the
    worker's :class:`ModelRunner` once built (it must pickle by reference: instrumentation,
    fault injection). In the engine's process it is called with the runner just the same.
    With several worker ranks (``tensor_parallel * expert_parallel``), ``wrap_comm`` wraps
    each rank's tensor-parallel communicator (fault injection; it must pickle by
    reference). ``worker="launched"`` builds this rank's shard in this process, after
    joining the launcher's world. The device half is
    :func:`~deepinfer_kit.engine.runner.build.build_device` in every case.

    Raises:
        ConfigError: bad config values, an unknown device, an unsupported checkpoint, a
            KV budget too small for ``max_model_len``, or a component that does not fit
            (another pool size, a device component that cannot cross into the worker).
        CheckpointError: a checkpoint folder that cannot be loaded.
        EngineDeadError: the worker process exited while building.
    """
    config = config if config is not None else EngineConfig()
    if overrides:
        try:
            config = attrs.evolve(config, **overrides)
        except TypeError as exc:
            raise ConfigError(f"unknown EngineConfig field in {sorted(overrides)}: {exc}") from exc
    parts = components if components is not None else Components()
    check_speculative(config.speculative, config.model, config.max_model_len)  # before any weights
    check_components(config, parts)
    executor: OverlapExecutor | None = build(parts.executor, BuildContext(
        config=config, clock=time.monotonic, block_size=config.block_size))
    if executor is None:
        executor = default_executor(config.overlapped, config.worker == "process", config.device)
    depth = executor.depth if executor is not None else 0  # the overlap decision, read once
    if config.worker == "process":
        remote = start_workers(config, depth, parts.device_side(), worker_setup, wrap_comm)
        info = remote.runner.info
        try:
            tiers = remote_kv_tiers(config, remote.runner)
        except BaseException:
            remote.runner.close()
            raise
        return _engine(config, remote.runner, info.model, load_host_tokenizer(info.model), info.num_blocks,
                       info.max_model_len, executor, parts, trace, balancer=remote.balancer, connector=tiers)
    groups = launched_groups(config, engine_device(config)) if config.worker == "launched" else None
    if groups is not None and config.eplb is not None:
        raise ConfigError("eplb with worker='launched' is not built yet; set eplb=None")
    device = build_device(config, depth=depth, components=parts, groups=groups)
    connector = attach_kv_tiers(config, device.runner, parts, model=device.loaded.config, groups=groups)
    if worker_setup is not None:  # after the tiers, as in a worker: a setup may wrap their device side
        try:
            worker_setup(device.runner)
        except BaseException:
            if connector is not None:
                connector.close()
            raise
    return _engine(config, device.runner, device.loaded.config, device.loaded.tokenizer, device.num_blocks,
                   device.max_model_len, executor, parts, trace, balancer=device.balancer, connector=connector)


def check_components(config: EngineConfig, parts: Components) -> None:
    """Refuse, before any weights load or process starts, components that cannot work:
    device components that cannot cross into a worker process, speculation components
    without ``config.speculative`` (γ is its), and EPLB components without ``config.eplb``.

    Raises:
        ConfigError: names the component and what to do.
    """
    if config.worker == "process":
        if parts.kv_connector is not None:
            raise ConfigError("components.kv_connector builds both sides over one pool, in one process: "
                              "with worker='process' use kv_tiers (the worker holds the host slab)")
        parts.check_crosses()
    if config.speculative is None:
        spec = [k for k in ("drafter", "verify_planner", "draft_verifier") if getattr(parts, k) is not None]
        if spec:
            raise ConfigError(f"components.{spec[0]} needs speculative={{...}} (it sets num_draft, "
                              f"the drafts per round), got speculative=None")
    if config.eplb is None:
        eplb = [k for k in ("placement_policy", "replica_selector") if getattr(parts, k) is not None]
        if eplb:
            raise ConfigError(f"components.{eplb[0]} needs eplb={{...}}, got eplb=None")
    if parts.cost_model is not None:
        raise ConfigError("components.cost_model prices simulated steps: give it to build_simulator")


def _engine(
    config: EngineConfig, runner: StepRunner, mc: ModelConfig, tokenizer: Tokenizer | None,
    num_blocks: int, max_model_len: int, executor: OverlapExecutor | None,
    parts: Components, trace: Callable[[StepTrace], None] | None, *, balancer: Balancer | None = None,
    connector: KVConnectorScheduler | None = None,
) -> Engine:
    """The host half: scheduler, cache manager and tokenizer around ``runner``."""
    try:
        scheduler, cache = build_host_components(
            config, num_blocks=num_blocks, max_model_len=max_model_len, components=parts, windows=mc.sliding_windows,
            connector=connector)
        eos = mc.eos_token_ids
        if config.tokenizer is not None:
            tokenizer = load_tokenizer(config.tokenizer, eos_token_id=eos[0] if eos else None,
                                       bos_token_id=mc.bos_token_id, required=True)
        if isinstance(tokenizer, ByteTokenizer) and tokenizer.vocab_size != mc.vocab_size:
            # A checkpoint without tokenizer.json whose vocabulary is not bytes: the byte
            # fallback cannot decode its ids, so the engine takes token ids only.
            tokenizer = None
        return _assemble(runner, scheduler, cache, tokenizer, config, mc, executor, max_model_len,
                         balancer, trace)
    except BaseException:
        runner.close()  # a worker process must not outlive the engine that failed to build
        if connector is not None:
            connector.close()
        raise


def _assemble(runner: StepRunner, scheduler: Scheduler, cache: KVCacheManager, tokenizer: Tokenizer | None,
              config: EngineConfig, mc: ModelConfig, executor: OverlapExecutor | None, max_model_len: int,
              balancer: Balancer | None, trace: Callable[[StepTrace], None] | None) -> Engine:
    """The Engine over the built parts (see :func:`_engine`)."""
    eos = mc.eos_token_ids
    return Engine(
        runner=runner,
        scheduler=scheduler,
        cache=cache,
        tokenizer=tokenizer,
        vocab_size=mc.vocab_size,
        eos_token_id=eos[0] if eos else None,
        extra_eos_token_ids=eos[1:],
        executor=executor,
        max_logprobs=config.max_logprobs,
        max_model_len=max_model_len,
        tokenizer_note=missing_tokenizer_reason(mc.folder) if tokenizer is None else None,
        balancer=balancer,
        num_draft=config.speculative.num_draft if config.speculative is not None else 0,
        trace=trace,
        strict_components=config.strict_components,
    )


def load_host_tokenizer(mc: ModelConfig) -> Tokenizer:
    """The tokenizer the model's loader would give (the checkpoint folder's, else the
    byte-level one), for a host whose model lives in a worker process."""
    if mc.folder is None:
        return ByteTokenizer()
    eos = mc.eos_token_ids
    return load_tokenizer(mc.folder, eos_token_id=eos[0] if eos else None, bos_token_id=mc.bos_token_id)
