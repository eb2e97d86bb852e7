"""KV pool sizing: blocks from a memory budget (CPU) or free device memory (CUDA), and the
``max_model_len`` that pool can serve; also resolves ``dtype="auto"`` and its aliases."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from deepinfer_kit._dtypes import DTYPE_ALIASES, auto_dtype, torch_dtype
from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.engine.config import DEFAULT_KV_CACHE_MEMORY_MB
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.config import ModelConfig

__all__ = ["activation_reserve_bytes", "resolve_dtype", "kv_budget_bytes", "size_kv_pool"]

MemGetInfo = Callable[[torch.device], "tuple[int, int]"]
EmptyCache = Callable[[], None]


def resolve_dtype(name: str, checkpoint: Mapping[str, Any] | None, device_type: str = "cpu") -> str:
    """The dtype name (one of ``DTYPE_NAMES``) that ``name`` means for a model on a device.

    ``"auto"`` follows :func:`~deepinfer_kit._dtypes.auto_dtype` on the checkpoint's
    ``torch_dtype`` (transformers 5: ``dtype``): bfloat16 on CUDA for a float32 checkpoint,
    the checkpoint's own dtype otherwise; ``None`` (the embedded models) is float32 on
    every device. ``"half"``, ``"float"``, ``"bf16"`` … are aliases.

    Raises:
        ConfigError: an unknown name, or a checkpoint dtype that is not supported.
    """
    if name == "auto":
        if checkpoint is None:
            return "float32"
        raw = checkpoint.get("torch_dtype") or checkpoint.get("dtype")
        return auto_dtype(None if raw is None else str(raw), device_type)
    resolved = DTYPE_ALIASES.get(name, name)
    torch_dtype(resolved)  # raises ConfigError naming dtype
    return resolved


def kv_budget_bytes(
    device: torch.device,
    *,
    kv_cache_memory_mb: int | None,
    gpu_memory_utilization: float,
    reserve_bytes: int = 0,
    mem_get_info: MemGetInfo | None = None,
    empty_cache: EmptyCache | None = None,
) -> tuple[int, str]:
    """Bytes the KV pool may take, and a phrase saying where the number came from.

    Called once, after the weights were loaded. On CPU: ``kv_cache_memory_mb`` MiB
    (:data:`DEFAULT_KV_CACHE_MEMORY_MB` when ``None``). On CUDA (like vLLM): first the
    caching allocator's unused blocks are returned (``empty_cache``, default
    ``torch.cuda.empty_cache``: an engine built and dropped earlier in the process still
    holds its pool there, which ``mem_get_info`` counts as used), then ``total *
    gpu_memory_utilization - used - reserve_bytes``, where ``(free, total)`` comes from
    ``mem_get_info`` (default ``torch.cuda.mem_get_info``), ``used = total - free`` counts
    the weights just loaded and anything else on the device, and ``reserve_bytes`` is
    what warm-up, graph capture and a step's activations will take after the pool
    (:func:`activation_reserve_bytes`). ``kv_cache_memory_mb`` given on CUDA is the
    budget itself, refused when it exceeds that headroom.

    Raises:
        ConfigError: the CUDA budget is not positive, or ``kv_cache_memory_mb`` exceeds
            it (names the numbers and the fix).
    """
    if device.type != "cuda":
        mb = DEFAULT_KV_CACHE_MEMORY_MB if kv_cache_memory_mb is None else kv_cache_memory_mb
        return mb << 20, f"kv_cache_memory_mb={mb}"
    (empty_cache if empty_cache is not None else torch.cuda.empty_cache)()
    get = mem_get_info if mem_get_info is not None else torch.cuda.mem_get_info
    free, total = get(device)
    used = total - free
    budget = int(total * gpu_memory_utilization) - used - reserve_bytes
    where = (f"gpu_memory_utilization={gpu_memory_utilization} of {total >> 20} MiB "
             f"with {used >> 20} MiB in use and {reserve_bytes >> 20} MiB kept for activations")
    if budget <= 0:
        raise ConfigError(
            f"{where} leaves no memory for the KV cache ({budget >> 20} MiB); raise "
            f"gpu_memory_utilization or free device memory"
        )
    if kv_cache_memory_mb is None:
        return budget, where
    if kv_cache_memory_mb << 20 > budget:
        raise ConfigError(
            f"kv_cache_memory_mb={kv_cache_memory_mb} exceeds what {where} leaves "
            f"({budget >> 20} MiB); lower it or raise gpu_memory_utilization"
        )
    return kv_cache_memory_mb << 20, f"kv_cache_memory_mb={kv_cache_memory_mb}"


def activation_reserve_bytes(
    model: ModelConfig, *, max_num_seqs: int, max_num_batched_tokens: int, dtype: torch.dtype,
) -> int:
    """Device memory to keep free beside the KV pool for what runs after it is sized: the
    float32 logits of the largest round (``max(max_num_seqs, ...)`` rows of ``V``, twice:
    the graphs' shared buffer and the sampler's working copy) and the activations of a
    ``max_num_batched_tokens`` forward (the widest per-token intermediate, the fused
    gate/up projection or the attention's q/k/v, a few times over), plus 256 MiB for
    Triton's and cuBLAS's workspaces and the graphs' bookkeeping.

    An estimate from sizes only (no profiling run): vLLM measures the peak of a dummy
    forward instead; this keeps the sizing a pure function of the config.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    logits = 2 * max(max_num_seqs, 1) * model.vocab_size * 4
    q_k_v = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    widest = max(q_k_v, 2 * model.intermediate_size, model.hidden_size)
    activations = 4 * max_num_batched_tokens * widest * itemsize
    return logits + activations + (256 << 20)


def size_kv_pool(
    *,
    model: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    budget_bytes: int | None,
    budget_source: str,
    num_blocks: int | None,
    max_model_len: int | None,
) -> tuple[int, int]:
    """Blocks in the pool and the ``max_model_len`` served.

    ``num_blocks`` when given, else as many blocks as ``budget_bytes`` holds. A
    ``max_model_len`` left unset (``None``) takes the model's maximum, capped to the pool's
    capacity with a warning naming both numbers; one given explicitly must fit.

    Raises:
        ConfigError: not even one block fits the budget, or an explicit ``max_model_len``
            beyond the pool (the message gives the largest that fits).
    """
    P = block_size
    if num_blocks is None:
        assert budget_bytes is not None
        per_block = PagedKVCache.bytes_per_block(
            model.num_layers, P, model.num_kv_heads, model.head_dim, dtype
        )
        num_blocks = budget_bytes // per_block
        source = f"{budget_source} ({per_block} bytes per block)"
    else:
        source = f"num_blocks={num_blocks}"
    capacity = num_blocks * P
    if num_blocks < 1:
        raise ConfigError(
            f"{source} holds no KV block of {P} tokens, not even one for a single request; "
            f"give the KV cache more memory"
        )
    if max_model_len is not None and capacity < max_model_len:
        raise ConfigError(
            f"{source} holds {num_blocks} blocks of {P} tokens = {capacity} tokens, fewer than "
            f"max_model_len={max_model_len}; the largest max_model_len that fits is {capacity}"
        )
    served = max_model_len if max_model_len is not None else model.max_position_embeddings
    if capacity < served:
        warnings.warn(
            f"the model's max_model_len {served} does not fit the KV pool ({source}: "
            f"{num_blocks} blocks of {P} tokens); max_model_len capped to {capacity}",
            stacklevel=3,
        )
        served = capacity
    return num_blocks, served

