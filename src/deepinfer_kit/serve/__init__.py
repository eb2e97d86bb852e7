"""Serving: :class:`AsyncLLM` (an asyncio front over one background engine loop) and the
OpenAI-compatible HTTP server (``deepinfer-kit serve``, the ``serve`` extra)."""

from deepinfer_kit.serve.async_llm import AsyncLLM

__all__ = ["AsyncLLM"]
