"""The supported weight and KV dtypes: the one table of their names and torch dtypes.

Torch-free at import time (configs and the command line validate names without it);
torch is imported only when a name is turned into a ``torch.dtype``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer_kit.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPE_NAMES", "DTYPE_ALIASES", "auto_dtype", "torch_dtype", "dtype_name"]

#: Names accepted wherever a dtype is given as a string (configs, ``--dtype``).
DTYPE_NAMES: tuple[str, ...] = ("float32", "float16", "bfloat16")

#: vLLM's other dtype spellings and the names they mean (``"auto"`` is resolved per model).
DTYPE_ALIASES: dict[str, str] = {"half": "float16", "float": "float32", "bf16": "bfloat16",
                                 "fp16": "float16", "fp32": "float32"}


def auto_dtype(checkpoint_dtype: str | None, device_type: str) -> str:
    """What ``dtype="auto"`` means for a checkpoint (the one rule, read by ``EngineConfig``,
    ``LLM`` and the command line).

    On CUDA, vLLM's rule: a float32 checkpoint (or one naming no dtype) runs in bfloat16,
    a float16 or bfloat16 one in its own dtype. On any other device the checkpoint's own
    dtype, float32 when it names none (the CPU paths are written and tested in float32; vLLM
    would downcast float32 to bfloat16 there). The embedded models are not checkpoints in
    this sense: their builder passes float32 itself.

    Args:
        checkpoint_dtype: the checkpoint's ``torch_dtype`` (transformers 5: ``dtype``) as
            written in its config, aliases allowed, or ``None``.
        device_type: ``torch.device(...).type`` of the engine (``"cuda"``, ``"cpu"``).

    Raises:
        ConfigError: the checkpoint names a dtype that is not supported (names it).
    """
    raw = "float32" if checkpoint_dtype is None else DTYPE_ALIASES.get(checkpoint_dtype, checkpoint_dtype)
    if raw not in DTYPE_NAMES:
        raise ConfigError(
            f"dtype='auto' found the checkpoint's torch_dtype {checkpoint_dtype!r}, which is not "
            f"one of {list(DTYPE_NAMES)}; pass dtype explicitly"
        )
    return "bfloat16" if device_type == "cuda" and raw == "float32" else raw


def torch_dtype(name: str, field: str = "dtype") -> torch.dtype:
    """The ``torch.dtype`` called ``name`` (``"bfloat16"`` -> ``torch.bfloat16``).

    Args:
        name: one of :data:`DTYPE_NAMES`.
        field: the name of the setting ``name`` came from, for the error message.

    Raises:
        ConfigError: ``name`` is not one of :data:`DTYPE_NAMES` (names ``field`` and value).
    """
    if name not in DTYPE_NAMES:
        raise ConfigError(f"{field} must be one of {list(DTYPE_NAMES)}, got {name!r}")
    import torch

    dtype: torch.dtype = getattr(torch, name)
    return dtype


def dtype_name(dtype: torch.dtype, field: str = "dtype") -> str:
    """The name in :data:`DTYPE_NAMES` of ``dtype`` (``torch.bfloat16`` -> ``"bfloat16"``).

    Raises:
        ConfigError: ``dtype`` is not a supported dtype (names ``field`` and value).
    """
    for name in DTYPE_NAMES:
        if torch_dtype(name) == dtype:
            return name
    raise ConfigError(
        f"{field} must be one of {[f'torch.{n}' for n in DTYPE_NAMES]}, got {dtype!r}"
    )
