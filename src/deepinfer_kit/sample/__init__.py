"""sample/: sampling parameters and the Sampler (penalties, filtering, seeds, logprobs).

``SamplingParams`` is pure Python and imported eagerly: the request record and the
scheduler need it, and they must import without torch. The tensor-side names (the
samplers, their Protocols and records) are resolved on first use (PEP 562), so
``import deepinfer_kit.sample`` pulls in torch only when one of them is asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deepinfer_kit._lazy import lazy_attribute

from deepinfer_kit.sample.params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from deepinfer_kit.sample.functional import sample
    from deepinfer_kit.sample.naive import NaiveSampler
    from deepinfer_kit.sample.protocols import DrawOps, Sampler
    from deepinfer_kit.sample.records import SampleResult, SamplingBatch
    from deepinfer_kit.sample.vectorized import VectorizedSampler

_LAZY = {
    "Sampler": "deepinfer_kit.sample.protocols",
    "DrawOps": "deepinfer_kit.sample.protocols",
    "SamplingBatch": "deepinfer_kit.sample.records",
    "SampleResult": "deepinfer_kit.sample.records",
    "VectorizedSampler": "deepinfer_kit.sample.vectorized",
    "NaiveSampler": "deepinfer_kit.sample.naive",
    "sample": "deepinfer_kit.sample.functional",
}

__all__ = [
    "SamplingParams",
    "RequestOutputKind",
    "Sampler",
    "DrawOps",
    "SamplingBatch",
    "SampleResult",
    "VectorizedSampler",
    "NaiveSampler",
    "sample",
]


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _LAZY, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
