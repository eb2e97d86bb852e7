"""RejectionVerifier: strict speculative rejection sampling under each request's sampling
parameters, so the output follows the target distribution exactly."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepinfer_kit._staging import to_device
from deepinfer_kit._kernels import Impl
from deepinfer_kit.sample.distribution import target_probs
from deepinfer_kit.sample.protocols import Sampler
from deepinfer_kit.spec.records import VerifyResult
from deepinfer_kit.sample.rng import row_uniforms
from deepinfer_kit.spec.verify.kernels import select_verify_ops
from deepinfer_kit.spec.verify.ref_ops import accept_uniforms
from deepinfer_kit.spec.verify.rows import VerifyRows, accept_matching, check_rows

if TYPE_CHECKING:
    from deepinfer_kit.spec.protocols import DraftVerifier

__all__ = ["RejectionVerifier"]


class RejectionVerifier:
    """Verify drafts by strict rejection sampling against ``p_t``, the distribution the
    sampler draws from (penalties, ``min_tokens``, temperature, top-k, top-p, min-p).

    Deterministic drafts (``proposal.draft_probs is None``, i.e. one-hot): the sampler
    itself draws every verified row and drafts are accepted while they equal its token
    (:func:`~deepinfer_kit.spec.verify.rows.accept_matching`) — exact rejection sampling for a
    one-hot draft, and token for token what plain decoding with the same seeds draws
    from the same logits. Probabilistic drafts: :func:`~deepinfer_kit.spec.verify.ref_ops.rejection_sample`
    over ``p_t`` from :func:`~deepinfer_kit.sample.distribution.target_probs`. Greedy rows
    have a one-hot ``p_t``, so both paths reduce to greedy verification.

    Seeded rows are reproducible and batch-invariant: the acceptance test and the draw of
    output position ``q`` use streams keyed by ``(seed, q)``; unseeded rows consume
    ``batch.generator``.

    Args:
        sampler: draws the rows of deterministic drafts (the engine's own sampler).
        impl: the acceptance and residual draw of probabilistic drafts: ``"ref"`` (torch),
            ``"triton"`` (one fused kernel per call), or ``"auto"`` (Triton when CUDA is
            available). Chosen once here; both draw identical tokens from the same uniforms.
        match_only: verify probabilistic drafts as deterministic ones too (the sampler's
            own draw at each row, drafts kept while they equal it): a seeded request's
            tokens are then those plain decoding draws, whatever was drafted — what the
            batch-invariant mode needs — at the price of fewer accepted sampled drafts
            (``sum_x q(x) p(x)`` instead of ``sum_x min(p(x), q(x))`` per position). Exact
            either way.

    Raises:
        ConfigError: an unknown ``impl``.
        DeviceUnavailableError: ``impl="triton"`` without CUDA and without
            ``TRITON_INTERPRET=1``, or without Triton installed.
    """

    def __init__(self, sampler: Sampler, impl: Impl = "auto", *, match_only: bool = False) -> None:
        self.sampler = sampler
        self.match_only = match_only
        self._ops, self.impl = select_verify_ops(impl)

    def verify(self, rows: VerifyRows, draft_probs: torch.Tensor | None = None) -> VerifyResult:
        """See :meth:`DraftVerifier.verify`. ``rows.logits`` on any device;
        ``draft_probs`` ``[R, G, V]`` on the same device when given. Not mutated. One
        device-to-host copy of the result.

        Raises:
            InvariantError: rows that disagree, or a history token outside ``[0, V)``.
        """
        width = check_rows(rows, draft_probs)
        if draft_probs is None or self.match_only:
            tokens: list[int] = self.sampler(rows.logits, rows.batch).token_ids.tolist()
            return accept_matching(rows, tokens)
        return self._strict(draft_probs[:, :width], rows, width + 1)

    def _strict(self, draft_probs: torch.Tensor, rows: VerifyRows, depth: int) -> VerifyResult:
        """Rejection sampling over probabilities; ``depth = G + 1``."""
        num_req, vocab = len(rows.drafts), rows.logits.shape[1]
        dev = rows.logits.device
        flat_p = target_probs(rows.logits, rows.batch)
        where = to_device([r * depth + j for r, d in enumerate(rows.drafts) for j in range(len(d) + 1)],
                          torch.int64, dev)
        target = torch.zeros(num_req * depth, vocab, dtype=torch.float64, device=dev)
        target[where] = flat_p
        target = target.view(num_req, depth, vocab)
        fb = rows.batch
        u_draw = torch.zeros(num_req * depth, dtype=torch.float64, device=dev)
        u_draw[where] = row_uniforms(fb.seeds, fb.positions, fb.generator, dev)
        u_acc = torch.zeros(num_req * depth, dtype=torch.float64, device=dev)
        u_acc[where] = accept_uniforms(fb.seeds, fb.positions, fb.generator, dev)
        width = depth - 1
        padded = [t for d in rows.drafts for t in d + [0] * (width - len(d))]
        ids = to_device(padded, torch.int64, dev).view(num_req, width)
        lengths = to_device([len(d) for d in rows.drafts], torch.int64, dev)
        num_acc, token = self._ops.rejection_sample(
            target, draft_probs.to(dev, torch.float64), ids, lengths,
            u_acc.view(num_req, depth)[:, :width], u_draw.view(num_req, depth),
        )
        accepted: list[int] = num_acc.tolist()
        final: list[int] = token.tolist()
        out = [d[:a] + [t] for d, a, t in zip(rows.drafts, accepted, final)]
        return VerifyResult(token_ids=out, num_accepted=accepted)


if TYPE_CHECKING:
    _check: type[DraftVerifier] = RejectionVerifier
