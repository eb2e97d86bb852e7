"""vLLM's defaults for ``LLM`` and ``serve``: the device and dtype a checkpoint runs in when
none is given, and the sampling defaults of its ``generation_config.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deepinfer_kit._dtypes import DTYPE_ALIASES
from deepinfer_kit.errors import ConfigError

__all__ = ["GENERATION_FIELDS", "default_device", "default_dtype", "generation_defaults"]

#: ``generation_config.json`` keys vLLM takes as sampling defaults -> SamplingParams fields.
GENERATION_FIELDS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens",
}


def _is_checkpoint(model: str) -> bool:
    return Path(model).is_dir()


def default_device(model: str) -> str:
    """``"cuda"`` when a GPU is present and ``model`` is a checkpoint folder, else ``"cpu"``.

    The embedded models (``"tiny"``, ``"tiny-words"``) stay on the CPU: they are fixtures,
    and their outputs are compared across runs that name no device.
    """
    if not _is_checkpoint(model):
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _config_dtype(model: str) -> str | None:
    try:
        raw = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    value = raw.get("torch_dtype") or raw.get("dtype")
    return DTYPE_ALIASES.get(str(value), str(value)) if value is not None else None


def default_dtype(model: str, device: str) -> str:
    """What ``dtype="auto"`` means for ``LLM`` and ``serve`` (vLLM's rule, close to it):
    on CUDA the checkpoint's ``torch_dtype``, a float32 (or unnamed) one run in bfloat16;
    on CPU float32 (the CPU paths here are written and tested in float32), and the
    embedded models float32 everywhere."""
    if not device.startswith("cuda") or not _is_checkpoint(model):
        return "float32"
    found = _config_dtype(model)
    return "bfloat16" if found in (None, "float32") else found


def generation_defaults(model: str | None, generation_config: str) -> dict[str, Any]:
    """The sampling defaults (SamplingParams field -> value) of a ``generation_config.json``.

    Args:
        model: the checkpoint folder (an embedded model's name, or ``None`` for an
            engine built elsewhere: no file of its own).
        generation_config: ``"auto"`` reads ``model``'s file; ``"vllm"`` (or ``"none"``)
            turns the defaults off; any other value is a folder holding the file.

    Raises:
        ConfigError: the file is not valid JSON, or a folder named explicitly has none.
    """
    if generation_config in ("vllm", "none") or (generation_config == "auto" and model is None):
        return {}
    folder = Path(model if generation_config == "auto" and model is not None else generation_config)
    path = folder / "generation_config.json"
    if not path.is_file():
        if generation_config != "auto":
            raise ConfigError(
                f"generation_config {generation_config!r} has no generation_config.json"
            )
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"generation_config: {str(path)!r} cannot be read: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"generation_config: {str(path)!r} must hold a JSON object")
    return {field: raw[key] for key, field in GENERATION_FIELDS.items() if raw.get(key) is not None}
