"""A user's Sampler that honours the Protocol: mypy --strict must accept it."""

from __future__ import annotations

import torch

from deepinfer_kit.sample import Sampler, SampleResult, SamplingBatch


class ArgmaxSampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
        return SampleResult(token_ids=logits.argmax(dim=-1))


_check: type[Sampler] = ArgmaxSampler
