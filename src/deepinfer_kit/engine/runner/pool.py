"""The model and its KV pool on this engine's device: the device of a config, the weights'
dtype, the model (this rank's tensor-parallel shard) and the paged KV pool sized from the
budget (:mod:`~deepinfer_kit.engine.runner.kv_sizing`). Called by
:func:`~deepinfer_kit.engine.runner.build.build_device`, once per engine."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, cast

import attrs
import torch

from deepinfer_kit._dtypes import torch_dtype
from deepinfer_kit._kernels import Impl
from deepinfer_kit.cache.hybrid_kv import HybridKVCache
from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.cache.layer_groups import KVLayout
from deepinfer_kit.components import BuildContext, Components
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.engine.runner.assemble import build_tiny_model, load_model, moe_layer_factory
from deepinfer_kit.engine.runner.kv_sizing import activation_reserve_bytes, kv_budget_bytes, resolve_dtype, size_kv_pool
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.config import ModelConfig
from deepinfer_kit.models.embedded import TINY, embedded_checkpoint, is_embedded
from deepinfer_kit.models.parallel.shard import attention_shard

if TYPE_CHECKING:
    from deepinfer_kit.comm.world import ParallelGroups
    from deepinfer_kit.models.loader import LoadedModel

__all__ = ["engine_device", "check_kernel_impls", "model_dtype", "load_shard", "kv_pool"]


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


def check_kernel_impls(config: EngineConfig, device: torch.device) -> None:
    """Refuse, at build time, a Triton implementation asked for an engine off CUDA unless
    the kernels run under the interpreter (``TRITON_INTERPRET=1``, as the CPU tests do).

    A compiled kernel cannot read CPU tensors; left to the components, ``"triton"`` would
    resolve by whether the machine has a GPU, not by where the engine's tensors live.

    Raises:
        ConfigError: names the field, its value and the device.
    """
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return
    for field in ("attention_impl", "sampler_impl", "moe_impl"):
        if getattr(config, field) == "triton":
            raise ConfigError(
                f"{field}='triton' with device {config.device!r}: compiled Triton kernels "
                f"cannot read {device.type} tensors; use 'auto' or 'ref' (or set "
                f"TRITON_INTERPRET=1 before triton is imported to run them interpreted)"
            )


def model_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    """The weights' dtype on ``device``: ``config.dtype``, or with ``"auto"`` what the
    checkpoint's dtype means there (:func:`resolve_dtype`; the embedded models float32)."""
    embedded = config.model == TINY or is_embedded(config.model)
    raw = None if embedded or config.dtype != "auto" else ModelConfig.from_pretrained(config.model).raw
    return torch_dtype(resolve_dtype(config.dtype, raw, device.type))


def load_shard(config: EngineConfig, dtype: torch.dtype, device: torch.device,
               groups: ParallelGroups | None, components: Components | None = None,
               context: BuildContext | None = None) -> LoadedModel:
    """The model of ``config`` (this rank's tensor-parallel shard under ``groups``), its
    MoE layers with the injected routers and dispatchers of ``components`` (each built per
    layer from ``context``).

    Raises:
        ConfigError, CheckpointError: an unsupported or unreadable checkpoint.
    """
    tp = groups.tp if groups is not None else None
    attention_impl, moe_impl = cast(Impl, config.attention_impl), cast(Impl, config.moe_impl)
    sparse = None
    if components is not None and (components.router is not None or components.dispatcher is not None):
        sparse = moe_layer_factory(moe_impl, router=components.router, dispatcher=components.dispatcher,
                                   context=context)
    if config.model == TINY:
        return build_tiny_model(seed=config.seed, dtype=dtype, device=device, attention_impl=attention_impl,
                                moe_impl=moe_impl, tp=tp, sparse_mlp_factory=sparse,
                                batch_invariant=config.batch_invariant)
    path = embedded_checkpoint(config.model) if is_embedded(config.model) else config.model
    return load_model(path, dtype=dtype, device=device, attention_impl=attention_impl,
                      moe_impl=moe_impl, tp=tp, sparse_mlp_factory=sparse,
                      batch_invariant=config.batch_invariant)


def kv_pool(config: EngineConfig, mc: ModelConfig, dtype: torch.dtype, device: torch.device,
             groups: ParallelGroups | None) -> tuple[PagedKVCache | HybridKVCache, int, int]:
    """The KV pool (this rank's KV heads), its block count and the engine's length limit;
    per-group pools (:class:`HybridKVCache`) for a model with sliding-window layers under
    ``config.hybrid_kv_cache``; a keys-only pool of one latent row per token and layer,
    sized from the budget by that row's bytes, for DeepSeek-V3 (``ModelConfig.cache_row``).

    Raises:
        ConfigError: ``max_model_len`` beyond the model's, or a KV budget too small for it.
    """
    tp = groups.tp if groups is not None else None
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
    layout = config.kv_layout(mc.sliding_windows)
    if layout is not None:
        return _hybrid_pool(config, mc, layout, kv_heads, dtype, device, budget, source)
    row = mc.cache_row(kv_heads)  # DeepSeek-V3: one keys-only latent row per token and layer
    blocks = config.num_blocks
    if row.keys_only and budget is not None:  # size_kv_pool counts a K and a V plane
        per_block = PagedKVCache.bytes_per_block(mc.num_layers, config.block_size, row.num_heads,
                                                 row.head_dim, dtype, keys_only=True)
        blocks = budget // per_block
        if blocks < 1:
            raise ConfigError(f"{source} ({per_block} bytes per latent block) holds no KV block of "
                              f"{config.block_size} tokens; give the KV cache more memory")
    num_blocks, max_model_len = size_kv_pool(
        model=attrs.evolve(mc, num_kv_heads=row.num_heads, head_dim=row.head_dim),
        block_size=config.block_size, dtype=dtype, budget_bytes=budget, budget_source=source,
        num_blocks=blocks, max_model_len=config.max_model_len,
    )
    kv_cache = PagedKVCache(mc.num_layers, num_blocks, config.block_size, row.num_heads, row.head_dim,
                            dtype=dtype, device=device, impl=cast(Impl, config.attention_impl),
                            keys_only=row.keys_only)
    return kv_cache, num_blocks, max_model_len


def _hybrid_pool(config: EngineConfig, mc: ModelConfig, layout: KVLayout, kv_heads: int, dtype: torch.dtype,
                 device: torch.device, budget: int | None, source: str) -> tuple[HybridKVCache, int, int]:
    """Per-group pools: each sliding group sized for its windows
    (:meth:`EngineConfig.sliding_pool_sizes`), the full group from what the budget leaves (or
    ``config.num_blocks``). A model whose every layer slides has a full group without
    storage: its block ids are only names (as many as ``max_num_seqs`` sequences of
    ``max_model_len`` tokens, twice over for the prefix cache)."""
    P = config.block_size
    layer_token_bytes = PagedKVCache.bytes_per_block(1, 1, kv_heads, mc.head_dim, dtype)
    num_blocks, budget = config.full_group_share(layout, budget, layer_token_bytes,
                                                 config.max_model_len or mc.max_position_embeddings)
    full_layers = len(layout.layers_of(0))
    num_blocks, max_model_len = size_kv_pool(
        # the full group's layers only (one when it has none: its blocks are names, given above)
        model=attrs.evolve(mc, num_kv_heads=kv_heads, num_layers=max(full_layers, 1), sliding_windows=(),
                           sparse_layers=(), moe=None),
        block_size=P, dtype=dtype,
        budget_bytes=budget, budget_source=source, num_blocks=num_blocks, max_model_len=config.max_model_len,
    )
    kv_cache = HybridKVCache(layout, num_blocks, config.sliding_pool_sizes(layout), P, kv_heads, mc.head_dim,
                             dtype=dtype, device=device,
                             impl=cast(Impl, config.attention_impl))
    return kv_cache, num_blocks, max_model_len
