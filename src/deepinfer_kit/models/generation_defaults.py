"""vLLM's defaults for ``LLM`` and ``serve``: the device a checkpoint runs on when none is
given, and the sampling defaults of its ``generation_config.json`` (the dtype's ``"auto"`` is
:func:`~deepinfer_kit._dtypes.auto_dtype`, read by the engine's builder)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deepinfer_kit.errors import ConfigError

__all__ = ["GENERATION_FIELDS", "default_device", "generation_defaults"]

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
