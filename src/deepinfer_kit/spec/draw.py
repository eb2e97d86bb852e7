"""draw_drafts: one draft position of a batch of requests drawn from draft logits under each
request's own sampling parameters (shared by the model drafters)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer_kit.spec.protocols import DraftSequence
from deepinfer_kit.sample.distribution import target_probs
from deepinfer_kit.sample.records import SamplingBatch
from deepinfer_kit.sample.rng import mix64, row_uniforms
from deepinfer_kit.spec.ref_ops import inverse_cdf

__all__ = ["draw_drafts"]

_DRAFT_SALT = 0x2545F4914F6CDD1D  # separates the draft's stream from the sampler's and acceptance's


def draw_drafts(logits: torch.Tensor, requests: Sequence[DraftSequence],
                previous: Sequence[Sequence[int]], j: int, *, greedy: bool,
                generator: torch.Generator | None) -> tuple[list[int], torch.Tensor | None,
                                                             torch.Tensor]:
    """Draw draft ``j`` of each request.

    Args:
        logits: ``[n, V]`` float32 draft logits, one row per request.
        requests: the ``n`` requests (their params, seeds and tokens so far).
        previous: each request's drafts ``0 .. j - 1`` (penalties and positions see them).
        j: the draft position (the seeded stream's position offset).
        greedy: every request of the round is greedy: argmax drafts unless one has
            penalties or ``min_tokens`` (then its processed distribution is used).
        generator: random source of unseeded sampled requests (on ``logits``' device).

    Returns:
        ``(tokens, q, p)``: the ``n`` drafted ids; ``q [n, V]`` float64, the processed
        distribution each was drawn from (``None`` for argmax drafts); ``p [n]`` float32 on
        the CPU, the temperature-1 softmax probability of each drafted token. Mutates only
        ``generator``'s state.
    """
    q: torch.Tensor | None = None
    if greedy and not any(r.params.has_penalties or r.params.min_tokens for r in requests):
        tok = logits.argmax(dim=-1)
    else:
        batch = SamplingBatch(
            params=[r.params for r in requests],
            seeds=[None if r.seed is None else mix64(r.seed ^ _DRAFT_SALT) >> 1 for r in requests],
            positions=[len(r.output_token_ids) + j for r in requests],
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=[(*r.output_token_ids, *prev[:j]) for r, prev in zip(requests, previous)],
            eos_token_ids=[r.eos_token_id for r in requests],
            generator=generator,
        )
        q = target_probs(logits, batch)
        u = row_uniforms(batch.seeds, batch.positions, generator, logits.device)
        tok = inverse_cdf(q, u)
    p = torch.softmax(logits.float(), dim=-1).gather(1, tok.unsqueeze(1)).squeeze(1)
    return tok.tolist(), q, p.cpu()
