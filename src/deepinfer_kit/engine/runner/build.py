"""build_runner: the device half of an engine — model, KV pool, sampler, runner — from an
EngineConfig; the same code in the engine's process and in a worker process."""

from __future__ import annotations

from typing import cast

import attrs
import torch

from deepinfer_kit._dtypes import torch_dtype
from deepinfer_kit._kernels import Impl
from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.comm.protocols import Communicator
from deepinfer_kit.engine.runner.assemble import build_tiny_model, load_model
from deepinfer_kit.engine.runner.balance import ExpertBalancer, moe_layers
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.engine.runner.kv_sizing import (
    activation_reserve_bytes,
    kv_budget_bytes,
    resolve_dtype,
    size_kv_pool,
)
from deepinfer_kit.engine.runner.model_runner import ModelRunner
from deepinfer_kit.engine.runner.static_decode import StaticDecode
from deepinfer_kit.engine.runner.token_slots import TokenSlots
from deepinfer_kit.engine.runner.warmup import warm_up
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.config import ModelConfig
from deepinfer_kit.models.embedded import TINY, embedded_checkpoint, is_embedded
from deepinfer_kit.models.loader import LoadedModel
from deepinfer_kit.models.parallel.shard import attention_shard
from deepinfer_kit.sample.protocols import Sampler
from deepinfer_kit.spec.verify.rejection import RejectionVerifier

__all__ = ["RunnerParts", "build_runner", "engine_device"]


@attrs.define(slots=True, eq=False)
class RunnerParts:
    """What :func:`build_runner` made.

    Attributes:
        loaded: the model, its config and tokenizer.
        runner: the runner over the model and its KV pool (its balancer not yet attached).
        num_blocks: blocks in the pool (sized from the budget when the config left it open).
        max_model_len: the engine's limit (capped to the pool when the config left it open).
        dtype: weights and KV dtype.
        device: the model's device.
        balancer: live EPLB when ``config.eplb`` (the engine attaches it after building).
    """

    loaded: LoadedModel
    runner: ModelRunner
    num_blocks: int
    max_model_len: int
    dtype: torch.dtype
    device: torch.device
    balancer: ExpertBalancer | None


def engine_device(config: EngineConfig) -> torch.device:
    """The torch device of ``config``.

    Raises:
        ConfigError: not a device string, or CUDA asked for and missing.
    """
    try:
        device = torch.device(config.device)
    except RuntimeError as exc:
        raise ConfigError(f"device must be a torch device string, got {config.device!r}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {config.device!r} asked for, but CUDA is not available")
    return device


def build_runner(config: EngineConfig, *, sampler: Sampler | None, depth: int,
                 tp: Communicator | None = None) -> RunnerParts:
    """Load the model of ``config`` and build the runner over it: the KV pool sized from
    the budget, the sampler (``sampler``, else the vectorized one), a verifier under
    ``speculative``, static decode buffers where they apply, token slots for an executor
    of ``depth`` 1; on CUDA every kernel warmed up and the decode graphs captured.

    Called once per engine: by ``build_engine`` in the engine's process, or in a worker
    process by :mod:`deepinfer_kit.engine.remote.worker_main`. With ``tp`` (a tensor-parallel
    group: collective) the model is this rank's shard and the KV pool holds its KV heads.

    Raises:
        ConfigError: bad config values, an unknown device, an unsupported checkpoint,
            ``max_model_len`` beyond the model's, or a KV budget too small for it.
        CheckpointError: a checkpoint folder that cannot be loaded.
    """
    from deepinfer_kit.sample.vectorized import VectorizedSampler

    device = engine_device(config)
    dtype = torch_dtype(resolve_dtype(
        config.dtype,
        None if config.model == TINY or config.dtype != "auto"
        else ModelConfig.from_pretrained(
            embedded_checkpoint(config.model) if is_embedded(config.model) else config.model
        ).raw,
    ))
    attention_impl = cast(Impl, config.attention_impl)
    moe_impl = cast(Impl, config.moe_impl)
    if config.model == TINY:
        loaded = build_tiny_model(
            seed=config.seed, dtype=dtype, device=device, attention_impl=attention_impl, moe_impl=moe_impl,
            tp=tp,
        )
    else:
        path = embedded_checkpoint(config.model) if is_embedded(config.model) else config.model
        loaded = load_model(
            path, dtype=dtype, device=device, attention_impl=attention_impl, moe_impl=moe_impl, tp=tp
        )
    mc = loaded.config
    kv_heads = mc.num_kv_heads if tp is None else attention_shard(mc, tp.world_size, tp.rank).num_kv_heads
    if config.max_model_len is not None and config.max_model_len > mc.max_position_embeddings:
        raise ConfigError(
            f"max_model_len must be <= the model's max_position_embeddings "
            f"({mc.max_position_embeddings}), got {config.max_model_len}"
        )
    budget, source = (None, "") if config.num_blocks is not None else kv_budget_bytes(
        device, kv_cache_memory_mb=config.kv_cache_memory_mb,
        gpu_memory_utilization=config.gpu_memory_utilization,
        reserve_bytes=activation_reserve_bytes(
            mc, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, dtype=dtype),
    )
    num_blocks, max_model_len = size_kv_pool(
        model=attrs.evolve(mc, num_kv_heads=kv_heads), block_size=config.block_size, dtype=dtype,
        budget_bytes=budget,
        budget_source=source, num_blocks=config.num_blocks, max_model_len=config.max_model_len,
    )
    kv_cache = PagedKVCache(
        mc.num_layers, num_blocks, config.block_size, kv_heads, mc.head_dim,
        dtype=dtype, device=device, impl=attention_impl,
    )
    on_cuda = device.type == "cuda"
    balancer = (ExpertBalancer(config.eplb, moe_layers(loaded.model), device)
                if config.eplb is not None and config.expert_parallel == 1 else None)  # EP: after sharding
    static = balancer is None and (config.static_decode if config.static_decode is not None else (
        on_cuda and config.cuda_graphs))
    sampler = sampler if sampler is not None else VectorizedSampler(impl=cast(Impl, config.sampler_impl))
    verifier = None if config.speculative is None else RejectionVerifier(
        sampler, cast(Impl, config.sampler_impl))
    runner = ModelRunner(
        loaded.model,
        kv_cache,
        sampler,
        device=device,
        generator=torch.Generator(device=device).manual_seed(config.seed),
        static_decode=StaticDecode(loaded.model, kv_cache, max_num_seqs=config.max_num_seqs,
                                   max_model_len=max_model_len) if static else None,
        verifier=verifier,
        token_slots=TokenSlots((depth + 1) * config.max_num_seqs, device) if depth else None,
    )
    if on_cuda:
        warm_up(runner, max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=max_model_len, capture=config.cuda_graphs and bool(static))
    return RunnerParts(loaded, runner, num_blocks, max_model_len, dtype, device, balancer)
