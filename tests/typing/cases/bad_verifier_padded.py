"""A DraftVerifier still written for the padded layout (proposal, lengths, [R, G+1, V]
logits, batch): the Protocol now hands it the flat rows, so mypy must reject it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from deepinfer_kit.sample.records import SamplingBatch
from deepinfer_kit.spec.protocols import DraftVerifier
from deepinfer_kit.spec.records import DraftProposal, VerifyResult


class PaddedVerifier:
    def verify(self, proposal: DraftProposal, lengths: Sequence[int], target_logits: torch.Tensor,
               batch: SamplingBatch) -> VerifyResult:
        return VerifyResult(token_ids=[[0] for _ in lengths], num_accepted=[0] * len(lengths))


if TYPE_CHECKING:
    _check: type[DraftVerifier] = PaddedVerifier
