"""Serving: :class:`AsyncLLM` (an asyncio front over one background engine loop) and the
OpenAI-compatible HTTP server (``deepinfer-kit serve``, the ``serve`` extra).

``AsyncLLM`` is imported on first use, so that the CLI can register the ``serve``
options (:mod:`deepinfer_kit.serve.command`) without importing the engine and torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deepinfer_kit.serve.async_llm import AsyncLLM

__all__ = ["AsyncLLM"]


def __getattr__(name: str) -> Any:
    """``deepinfer_kit.serve.AsyncLLM``, imported when first read.

    Raises:
        AttributeError: any other name.
    """
    if name == "AsyncLLM":
        from deepinfer_kit.serve.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
