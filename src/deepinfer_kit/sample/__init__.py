"""sample/: sampling parameters and the Sampler (penalties, filtering, seeds, logprobs)."""

from deepinfer_kit.sample.naive import NaiveSampler
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sample.protocols import DrawOps, Sampler
from deepinfer_kit.sample.records import SampleResult, SamplingBatch
from deepinfer_kit.sample.vectorized import VectorizedSampler

__all__ = [
    "SamplingParams",
    "Sampler",
    "DrawOps",
    "SamplingBatch",
    "SampleResult",
    "VectorizedSampler",
    "NaiveSampler",
]
