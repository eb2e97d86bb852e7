"""deepinfer_kit: composable LLM-inference components behind typed Protocols.

Importing the package needs neither a GPU nor Triton. The engine-level names (``LLM``,
``Engine``, ``EngineConfig``, ``build_engine``, ``Components``, ``Factory``,
``BuildContext``) are imported lazily on first use.
"""

from __future__ import annotations

from typing import Any

from deepinfer_kit._lazy import lazy_attribute

from deepinfer_kit.errors import (
    CapacityError,
    CheckpointError,
    ConfigError,
    DeepInferError,
    DeviceUnavailableError,
    EngineDeadError,
    GraphCaptureError,
    InvariantError,
    OutOfBlocksError,
)
from deepinfer_kit.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from deepinfer_kit.request import FinishReason, Request, RequestStatus
from deepinfer_kit.sample.params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"

_LAZY = {
    "LLM": "deepinfer_kit.engine.llm",
    "Engine": "deepinfer_kit.engine.engine",
    "EngineConfig": "deepinfer_kit.engine.config",
    "build_engine": "deepinfer_kit.engine.build",
    "AsyncLLM": "deepinfer_kit.serve.async_llm",
    "Components": "deepinfer_kit.components",
    "Factory": "deepinfer_kit.components",
    "BuildContext": "deepinfer_kit.components",
}

__all__ = [
    "LLM",
    "Engine",
    "EngineConfig",
    "build_engine",
    "AsyncLLM",
    "Components",
    "Factory",
    "BuildContext",
    "SamplingParams",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "RequestMetrics",
    "Request",
    "RequestStatus",
    "FinishReason",
    "DeepInferError",
    "ConfigError",
    "CheckpointError",
    "CapacityError",
    "OutOfBlocksError",
    "InvariantError",
    "DeviceUnavailableError",
    "GraphCaptureError",
    "EngineDeadError",
]


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _LAZY, name)
