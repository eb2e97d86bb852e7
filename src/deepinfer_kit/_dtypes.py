"""The supported weight and KV dtypes: the one table of their names and torch dtypes.

Torch-free at import time (configs and the command line validate names without it);
torch is imported only when a name is turned into a ``torch.dtype``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer_kit.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPE_NAMES", "DTYPE_ALIASES", "torch_dtype", "dtype_name"]

#: Names accepted wherever a dtype is given as a string (configs, ``--dtype``).
DTYPE_NAMES: tuple[str, ...] = ("float32", "float16", "bfloat16")

#: vLLM's other dtype spellings and the names they mean (``"auto"`` is resolved per model).
DTYPE_ALIASES: dict[str, str] = {"half": "float16", "float": "float32", "bf16": "bfloat16",
                                 "fp16": "float16", "fp32": "float32"}


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
