"""GreedyVerifier: accept while the target's argmax equals the draft."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from deepinfer_kit.sample.records import SamplingBatch
from deepinfer_kit.sample.vectorized import working_logits
from deepinfer_kit.spec.records import DraftProposal, VerifyResult
from deepinfer_kit.spec.rows import accept_matching, flatten_verify

if TYPE_CHECKING:
    from deepinfer_kit.spec.protocols import DraftVerifier

__all__ = ["GreedyVerifier"]


class GreedyVerifier:
    """Greedy verification for every row, whatever its temperature.

    The target's choice at each row is the argmax of the logits after penalties and the
    ``min_tokens`` mask (lowest id on ties), exactly what the sampler picks for a greedy
    row; drafts are accepted while they equal it, then the target's own token follows.
    The spec-decoded output of a greedy request therefore equals plain greedy decoding.
    """

    def verify(
        self,
        proposal: DraftProposal,
        lengths: Sequence[int],
        target_logits: torch.Tensor,
        batch: SamplingBatch,
    ) -> VerifyResult:
        """See :meth:`DraftVerifier.verify`. One device-to-host copy of ``[M]`` ids.

        Raises:
            InvariantError: shapes that disagree or lengths out of range.
        """
        rows = flatten_verify(proposal, lengths, target_logits, batch)
        x = working_logits(rows.logits, rows.batch)
        tokens: list[int] = x.argmax(dim=-1).tolist()
        return accept_matching(rows, tokens)


if TYPE_CHECKING:
    _check: type[DraftVerifier] = GreedyVerifier
