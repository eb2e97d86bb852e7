"""Contract of the sample package: the Sampler."""

from __future__ import annotations

from typing import Protocol

import torch

from deepinfer_kit.sample.records import SampleResult, SamplingBatch

__all__ = ["Sampler"]


class Sampler(Protocol):
    """Turns one row of logits per sequence into the next token.

    Seeded rows are batch-invariant: given identical logits, a row with seed ``s`` at
    output position ``j`` draws the same token whatever other rows share the batch.
    """

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
        """Apply penalties, ``min_tokens`` masking, temperature, top-k / top-p / min-p and
        draw one token per row.

        Args:
            logits: ``[N, V]`` float (fp32, fp16 or bf16) on any device; not mutated.
            batch: ``N`` rows of parameters and history.

        Returns:
            A :class:`SampleResult` on the device of ``logits``.

        Raises:
            InvariantError: ``logits.shape[0] != len(batch)``.
        """
        ...
