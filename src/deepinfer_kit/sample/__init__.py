"""sample/: sampling parameters and the Sampler (penalties, filtering, seeds, logprobs)."""

from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sample.protocols import Sampler
from deepinfer_kit.sample.records import SampleResult, SamplingBatch

__all__ = ["SamplingParams", "Sampler", "SamplingBatch", "SampleResult"]
