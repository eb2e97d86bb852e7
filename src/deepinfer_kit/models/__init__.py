"""models/: reference model definitions, checkpoint loading, paged attention.

The common entry points are importable from here (loaded lazily, so importing the package
costs nothing until one is used): :func:`load_model`, :func:`build_tiny_model`,
:class:`LoadedModel`, :class:`ModelConfig`, :class:`TransformerCausalLM`,
:class:`ByteTokenizer`, :class:`HFTokenizer`. Sparse (MoE) models need a
``sparse_mlp_factory``; ``deepinfer_kit.engine.runner.assemble`` has the loaders with the default one.
"""

from __future__ import annotations

from typing import Any

from deepinfer_kit._lazy import lazy_attribute

_LAZY = {
    "load_model": "deepinfer_kit.models.loader",
    "build_tiny_model": "deepinfer_kit.models.loader",
    "LoadedModel": "deepinfer_kit.models.loader",
    "ModelConfig": "deepinfer_kit.models.config",
    "TransformerCausalLM": "deepinfer_kit.models.causal_lm",
    "ByteTokenizer": "deepinfer_kit.models.tokenizer",
    "HFTokenizer": "deepinfer_kit.models.tokenizer",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _LAZY, name)
