"""A Sampler returning the wrong type: mypy --strict must reject it."""

from __future__ import annotations

import torch

from deepinfer_kit.sample import Sampler, SamplingBatch


class TensorSampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        return logits.argmax(dim=-1)


_check: type[Sampler] = TensorSampler  # error: incompatible return type
