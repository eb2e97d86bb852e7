"""draw_drafts: one draft position of a batch of requests drawn from draft logits under each
request's own sampling parameters, with a confidence that does not read the drawn token
(shared by the model drafters).

Why the confidence must not read the draw: a planner that picks how many drafts to verify
from the confidences would otherwise let the value of draft ``j`` decide whether draft ``j``
is verified. Strict rejection sampling is exact only when the decision to verify draft
``j`` is a function of what was known before it was drawn (the earlier drafts, the
context): the verify length must be a stopping time of the draft sequence (the
non-anticipating condition of the DSpark paper, Appendix A). A confidence equal to the
probability of the token just drawn favours the drafts the draft model likes and biases
the output towards them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer_kit.spec.protocols import DraftSequence
from deepinfer_kit.sample.distribution import target_probs
from deepinfer_kit.sample.records import SamplingBatch
from deepinfer_kit.sample.rng import mix64, row_uniforms
from deepinfer_kit.spec.verify.ref_ops import inverse_cdf

__all__ = ["draw_drafts", "draft_confidence"]

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
        ``(tokens, q, c)``: the ``n`` drafted ids; ``q [n, V]`` float64, the processed
        distribution each was drawn from (``None`` for argmax drafts); ``c [n]`` float32 on
        the CPU, each draft's confidence (:func:`draft_confidence`, computed from the
        logits before the draw). Mutates only ``generator``'s state.
    """
    if greedy and not any(r.params.has_penalties or r.params.min_tokens for r in requests):
        tok = logits.argmax(dim=-1)
        return tok.tolist(), None, draft_confidence(logits, None)
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
    conf = draft_confidence(logits, q)  # before the draw: it must not read the token
    tok = inverse_cdf(q, u)
    return tok.tolist(), q, conf


def draft_confidence(logits: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
    """The confidence of the draft about to be drawn from ``q``: ``E_{x ~ q}[s(x)]``, with
    ``s`` the draft model's temperature-1 softmax of ``logits`` — the expected probability
    the draft model gives its own draft. For an argmax draft (``q`` ``None``, or one-hot)
    this is ``max s``, the probability of the argmax.

    A function of the logits and of ``q`` only, never of the token drawn from them, so a
    planner reading it is non-anticipating (module docstring). Called by
    :func:`draw_drafts` before each draw; pure.

    Args:
        logits: ``[n, V]`` draft logits (any float dtype, any device).
        q: ``[n, V]`` the processed distribution drafts are drawn from (rows summing to 1,
            same device), or ``None`` for argmax drafts.

    Returns:
        ``[n]`` float32 in ``[0, 1]`` on the CPU.
    """
    s = torch.softmax(logits.float(), dim=-1)
    if q is None:
        return s.amax(dim=-1).cpu()
    return (q.to(s.dtype) * s).sum(dim=-1).clamp(0.0, 1.0).cpu()
