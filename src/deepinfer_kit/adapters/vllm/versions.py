"""The vLLM releases the vLLM adapters were tested with."""

from __future__ import annotations

__all__ = ["TESTED_VLLM"]

TESTED_VLLM: tuple[str, ...] = ("0.33",)
"""vLLM releases (version prefixes) these adapters were tested with."""
