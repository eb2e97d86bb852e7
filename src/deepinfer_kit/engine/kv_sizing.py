"""KV pool sizing: blocks from a memory budget (CPU) or free device memory (CUDA), and the
``max_model_len`` that pool can serve; also resolves ``dtype="auto"`` and its aliases."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from deepinfer_kit._dtypes import DTYPE_ALIASES, DTYPE_NAMES, torch_dtype
from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.config import ModelConfig

__all__ = ["resolve_dtype", "kv_budget_bytes", "size_kv_pool"]

MemGetInfo = Callable[[torch.device], "tuple[int, int]"]


def resolve_dtype(name: str, checkpoint: Mapping[str, Any] | None) -> str:
    """The dtype name (one of ``DTYPE_NAMES``) that ``name`` means for a model.

    ``"auto"`` takes the checkpoint's ``torch_dtype`` (transformers 5: ``dtype``) and
    ``float32`` when the checkpoint names none or has no config (the embedded model);
    ``"half"``, ``"float"``, ``"bf16"`` … are aliases.

    Raises:
        ConfigError: an unknown name, or a checkpoint dtype that is not supported.
    """
    if name == "auto":
        raw = (checkpoint or {}).get("torch_dtype") or (checkpoint or {}).get("dtype") or "float32"
        resolved = DTYPE_ALIASES.get(str(raw), str(raw))
        if resolved not in DTYPE_NAMES:
            raise ConfigError(
                f"dtype='auto' found the checkpoint's torch_dtype {raw!r}, which is not one of "
                f"{list(DTYPE_NAMES)}; pass dtype explicitly"
            )
        return resolved
    resolved = DTYPE_ALIASES.get(name, name)
    torch_dtype(resolved)  # raises ConfigError naming dtype
    return resolved


def kv_budget_bytes(
    device: torch.device,
    *,
    kv_cache_memory_mb: int,
    gpu_memory_utilization: float,
    mem_get_info: MemGetInfo | None = None,
) -> tuple[int, str]:
    """Bytes the KV pool may take, and a phrase saying where the number came from.

    Called once, after the weights were loaded. On CPU: ``kv_cache_memory_mb`` MiB. On
    CUDA (like vLLM): ``total * gpu_memory_utilization - used``, where ``(free, total)``
    comes from ``mem_get_info`` (default ``torch.cuda.mem_get_info``) and ``used = total -
    free`` counts the weights just loaded and anything else on the device.

    Raises:
        ConfigError: the CUDA budget is not positive (names the numbers and the fix).
    """
    if device.type != "cuda":
        return kv_cache_memory_mb << 20, f"kv_cache_memory_mb={kv_cache_memory_mb}"
    get = mem_get_info if mem_get_info is not None else torch.cuda.mem_get_info
    free, total = get(device)
    used = total - free
    budget = int(total * gpu_memory_utilization) - used
    where = (f"gpu_memory_utilization={gpu_memory_utilization} of {total >> 20} MiB "
             f"with {used >> 20} MiB in use")
    if budget <= 0:
        raise ConfigError(
            f"{where} leaves no memory for the KV cache ({budget >> 20} MiB); raise "
            f"gpu_memory_utilization or free device memory"
        )
    return budget, where


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
