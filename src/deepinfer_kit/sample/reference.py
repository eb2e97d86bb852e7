"""The float64 spec of what a row samples from: temperature, top-k, top-p, min-p.

:func:`filtered_distribution` is the distribution every :class:`Sampler` must draw from
(after penalties and ``min_tokens`` masks); the conformance suite and the tests compare
samplers against it, and :class:`~deepinfer_kit.sample.NaiveSampler` draws from it.
"""

from __future__ import annotations

import torch

from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sample.plan import MAX_INV_TEMPERATURE

__all__ = ["canonical_order", "is_filtered", "filtered_distribution"]


def canonical_order(logits: torch.Tensor) -> torch.Tensor:
    """``[V]`` int64 token ids sorted by logit, highest first, ties by ascending id."""
    return torch.sort(logits, descending=True, stable=True).indices


def is_filtered(params: SamplingParams, vocab: int) -> bool:
    """True when top-k (``1 <= k < V``) or top-p (``< 1``) restricts the row."""
    return 1 <= params.top_k < vocab or params.top_p < 1.0


def filtered_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The probabilities one row draws from.

    Greedy (temperature 0 or top_k 1): all mass on the argmax (lowest id on ties), token 0
    for a row with no finite logit. Otherwise ``p = softmax(logits / T)``; in
    :func:`canonical_order`, top-k keeps the first ``k``; top-p keeps token ``j`` while the
    renormalized mass of the tokens before it is ``< top_p``; min-p keeps
    ``p_j >= min_p * max(p)``; the kept mass is renormalized.

    Args:
        logits: ``[V]`` float logits after penalties and masks.
        params: the row's parameters.

    Returns:
        ``[V]`` float64, summing to 1.
    """
    vocab = logits.shape[0]
    x = logits.double()
    if params.is_greedy or not bool(torch.isfinite(x).any()):
        onehot = torch.zeros(vocab, dtype=torch.float64)
        onehot[int(torch.argmax(x))] = 1.0
        return onehot
    probs = torch.softmax(x * min(1.0 / params.temperature, MAX_INV_TEMPERATURE), dim=0)
    order = canonical_order(logits)
    ranked = probs[order]
    keep = ranked > 0
    if 1 <= params.top_k < vocab:
        keep &= torch.arange(vocab) < params.top_k
    if params.top_p < 1.0:
        mass = torch.where(keep, ranked, 0.0)
        mass = mass / mass.sum()
        keep &= torch.cumsum(mass, 0) - mass < params.top_p
    keep &= ranked >= params.min_p * ranked[0]
    out = torch.zeros(vocab, dtype=torch.float64)
    out[order[keep]] = ranked[keep]
    return out / out.sum()
