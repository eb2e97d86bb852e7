"""The distributions the sampler draws from, as probabilities: every row of a batch at once.

:func:`target_probs` applies exactly the sampler's own processing — penalties and the
``min_tokens`` mask (``working_logits``), then temperature, top-k, top-p and min-p as
:func:`~deepinfer_kit.sample.reference.filtered_distribution` specifies them — and returns
the probabilities, vectorized over rows with different parameters. Strict rejection
sampling needs these (``p_t``) rather than one drawn token.
"""

from __future__ import annotations

import torch

from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sample.plan import MAX_INV_TEMPERATURE
from deepinfer_kit.sample.records import SamplingBatch
from deepinfer_kit.sample.vectorized import check_batch, working_logits

__all__ = ["filtered_probs", "target_probs"]


def filtered_probs(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p of every row, as probabilities.

    Row ``i`` equals ``filtered_distribution(x[i], params[i])`` (the float64 spec):
    greedy rows (and rows with no finite logit) are one-hot on the argmax, lowest id on
    ties; the others keep, in canonical order (logit descending, ties by ascending id),
    the first ``k``, then the tokens whose renormalised preceding mass is ``< top_p``,
    then ``p >= min_p * p_max``, and renormalise. O(N V log V).

    Args:
        x: ``[N, V]`` float logits after penalties; read only.
        params: ``[N]`` the rows' parameters.

    Returns:
        ``[N, V]`` float64 on ``x``'s device; each row sums to 1.
    """
    n, vocab = x.shape
    dev = x.device
    if n == 0:
        return torch.zeros(0, vocab, dtype=torch.float64, device=dev)
    xd = x.double()
    inv_t = torch.tensor(
        [1.0 if p.is_greedy else min(1.0 / p.temperature, MAX_INV_TEMPERATURE) for p in params],
        dtype=torch.float64, device=dev,
    )
    k = torch.tensor(
        [p.top_k if 1 <= p.top_k < vocab else vocab for p in params], dtype=torch.int64, device=dev
    )
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=dev)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float64, device=dev)
    probs = torch.softmax(xd * inv_t.unsqueeze(1), dim=1)
    order = torch.sort(x, dim=1, descending=True, stable=True).indices
    ranked = probs.gather(1, order)
    keep = (ranked > 0) & (torch.arange(vocab, device=dev) < k.unsqueeze(1))
    use_p = top_p < 1.0
    if bool(use_p.any()):
        mass = torch.where(keep, ranked, torch.zeros_like(ranked))
        mass = mass / mass.sum(dim=1, keepdim=True)
        below = torch.cumsum(mass, dim=1) - mass < top_p.unsqueeze(1)
        keep &= below | ~use_p.unsqueeze(1)
    keep &= ranked >= min_p.unsqueeze(1) * ranked[:, :1]
    out = torch.zeros_like(probs).scatter_(1, order, torch.where(keep, ranked, torch.zeros_like(ranked)))
    out = out / out.sum(dim=1, keepdim=True)
    onehot_rows = [i for i, p in enumerate(params) if p.is_greedy]
    no_finite = ~torch.isfinite(xd).any(dim=1)
    if bool(no_finite.any()):
        onehot_rows = sorted(set(onehot_rows) | set(no_finite.nonzero().flatten().tolist()))
    if onehot_rows:
        rows = torch.tensor(onehot_rows, dtype=torch.int64, device=dev)
        hot = torch.zeros(len(onehot_rows), vocab, dtype=torch.float64, device=dev)
        hot.scatter_(1, xd[rows].argmax(dim=1, keepdim=True), 1.0)
        out[rows] = hot
    return out


def target_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``[N, V]`` float64: what the sampler would draw each row from.

    Penalties and ``min_tokens`` masks first (the sampler's ``working_logits``), then
    :func:`filtered_probs`. ``logits`` is not mutated.

    Raises:
        InvariantError: mismatched shapes, or a history token outside ``[0, V)``.
    """
    check_batch(logits, batch)
    return filtered_probs(working_logits(logits, batch), batch.params)
