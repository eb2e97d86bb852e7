"""Records of the spec package: a draft proposal, a verification result, an SPS curve.

Shape symbols: ``R`` requests, ``γ`` (gamma) draft length, ``V`` vocabulary.
"""

from __future__ import annotations

import attrs
import torch

__all__ = ["DraftProposal", "VerifyResult", "SpsCurve"]


@attrs.define(slots=True, eq=False)
class DraftProposal:
    """Draft tokens for ``R`` requests.

    Attributes:
        token_ids: ``[R, γ]`` int64, drafted tokens (rows shorter than γ are padded; see
            ``num_drafted``).
        num_drafted: ``[R]`` drafts actually proposed per request (``<= γ``).
        draft_probs: ``[R, γ, V]`` float32, the drafter's distribution at each position
            (needed by strict rejection sampling); ``None`` for deterministic drafters,
            treated as one-hot on ``token_ids``.
        confidence: ``[R, γ]`` float32 in ``[0, 1]``, the drafter's estimate that each
            draft is accepted given the previous ones; ``None`` when not estimated.
    """

    token_ids: torch.Tensor
    num_drafted: list[int]
    draft_probs: torch.Tensor | None = None
    confidence: torch.Tensor | None = None


@attrs.define(slots=True, eq=False)
class VerifyResult:
    """Accepted tokens per request.

    Attributes:
        token_ids: ``[R]`` lists: the accepted drafts followed by one recovered (on
            rejection) or bonus (all accepted) token; length ``num_accepted + 1``.
        num_accepted: ``[R]`` accepted drafts, in ``[0, ℓ_r]``.
    """

    token_ids: list[list[int]]
    num_accepted: list[int]


@attrs.frozen(slots=True)
class SpsCurve:
    """Profiled steps per second as a function of verified tokens in a step, ``SPS(B)``.

    Attributes:
        batch_tokens: increasing token counts ``B`` at which SPS was measured.
        steps_per_second: the measured SPS at each count (linear interpolation between,
            constant beyond the ends).
    """

    batch_tokens: tuple[int, ...]
    steps_per_second: tuple[float, ...]

    def __call__(self, tokens: int) -> float:
        """``SPS(tokens)`` by linear interpolation."""
        xs, ys = self.batch_tokens, self.steps_per_second
        if tokens <= xs[0]:
            return ys[0]
        for i in range(1, len(xs)):
            if tokens <= xs[i]:
                frac = (tokens - xs[i - 1]) / (xs[i] - xs[i - 1])
                return ys[i - 1] + frac * (ys[i] - ys[i - 1])
        return ys[-1]
