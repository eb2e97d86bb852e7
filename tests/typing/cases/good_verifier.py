"""A DraftVerifier over the flat rows the runner lays out: accepted by mypy --strict."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepinfer_kit.spec.protocols import DraftVerifier
from deepinfer_kit.spec.records import VerifyResult, VerifyRows


class RejectNothingVerifier:
    def verify(self, rows: VerifyRows, draft_probs: torch.Tensor | None = None) -> VerifyResult:
        bonus = [rows.offsets[r] + len(d) for r, d in enumerate(rows.drafts)]
        tokens = rows.logits[bonus].argmax(dim=-1).tolist()
        return VerifyResult(token_ids=[[*d, t] for d, t in zip(rows.drafts, tokens)],
                            num_accepted=[len(d) for d in rows.drafts])


if TYPE_CHECKING:
    _check: type[DraftVerifier] = RejectNothingVerifier
