"""NaiveSampler: the obviously-correct per-row sampler — the oracle of the tests and the
baseline of the benchmark (a Python loop over rows, float64 softmax, a full sort of every
filtered row).

It follows the same conventions as :class:`~deepinfer_kit.sample.VectorizedSampler`, so
given the same uniforms the two draw the same tokens (up to float rounding at a CDF
boundary): rows with top-k / top-p draw by inverse CDF over the tokens sorted by logit
(highest first, ties by token id), other rows over the vocabulary in token order.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import torch

from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sample.protocols import Sampler
from deepinfer_kit.sample.records import SampleResult, SamplingBatch
from deepinfer_kit.sample.reference import canonical_order, filtered_distribution, is_filtered
from deepinfer_kit.sample.rng import row_uniforms
from deepinfer_kit.sample.vectorized import check_batch

__all__ = ["NaiveSampler"]


def _edit_row(x: torch.Tensor, params: SamplingParams, batch: SamplingBatch, i: int) -> None:
    """Penalties and the ``min_tokens`` mask of row ``i``, one token at a time."""
    outputs = list(batch.output_token_ids[i])
    if params.repetition_penalty != 1.0:
        for token in set(batch.prompt_token_ids[i]) | set(outputs):
            value = float(x[token])
            r = params.repetition_penalty
            x[token] = value / r if value > 0 else value * r
    for token, count in Counter(outputs).items():
        x[token] -= params.frequency_penalty * count + params.presence_penalty
    if len(outputs) < params.min_tokens:
        banned = set(params.stop_token_ids)
        eos = batch.eos_token_ids[i]
        if eos is not None and not params.ignore_eos:
            banned.add(eos)
        for token in banned:
            if token < x.shape[0]:
                x[token] = float("-inf")


def _draw_row(x: torch.Tensor, params: SamplingParams, u: float) -> int:
    """Inverse-CDF draw with uniform ``u`` from the row's filtered distribution."""
    dist = filtered_distribution(x, params)
    vocab = x.shape[0]
    order = canonical_order(x) if is_filtered(params, vocab) else torch.arange(vocab)
    ranked = dist[order]
    cdf = torch.cumsum(ranked, 0)
    j = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    return int(order[min(j, int((ranked > 0).nonzero().max()))])


class NaiveSampler:
    """A :class:`~deepinfer_kit.sample.Sampler` written for clarity, not speed.

    Per row: penalties and the ``min_tokens`` mask token by token, then an inverse-CDF draw
    from :func:`~deepinfer_kit.sample.reference.filtered_distribution` (float64 softmax,
    the whole row sorted for top-k / top-p) with the row's uniform (from :func:`~deepinfer_kit.sample.rng.row_uniforms`,
    so seeded rows are batch-invariant here too). A row with no finite logit draws token 0.
    """

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
        """Draw one token per row; see :meth:`Sampler.__call__` for the contract.

        Raises:
            InvariantError: mismatched shapes.
        """
        check_batch(logits, batch)
        raw = logits.detach().to("cpu", torch.float32)
        sampled = [i for i, p in enumerate(batch.params) if not p.is_greedy]
        uniforms = row_uniforms(
            [batch.seeds[i] for i in sampled],
            [batch.positions[i] for i in sampled],
            batch.generator,
            logits.device,
        ).tolist()
        u_of = dict(zip(sampled, uniforms))
        tokens = []
        for i, params in enumerate(batch.params):
            x = raw[i].clone()
            _edit_row(x, params, batch, i)
            tokens.append(_draw_row(x, params, u_of.get(i, 0.0)))
        result = SampleResult(token_ids=torch.tensor(tokens, dtype=torch.int64))
        if batch.max_logprobs >= 0:
            self._logprobs(result, raw, batch.max_logprobs)
        result.token_ids = result.token_ids.to(logits.device)
        for name in ("logprobs", "ranks", "top_token_ids", "top_logprobs"):
            value = getattr(result, name)
            if value is not None:
                setattr(result, name, value.to(logits.device))
        return result

    @staticmethod
    def _logprobs(result: SampleResult, raw: torch.Tensor, num_top: int) -> None:
        chosen, ranks, top_ids, top_lps = [], [], [], []
        for i in range(raw.shape[0]):
            lp = torch.log_softmax(raw[i].double(), dim=0)
            lp = torch.where(torch.isnan(lp), float("-inf"), lp)
            token = int(result.token_ids[i])
            chosen.append(float(lp[token]))
            ranks.append(1 + int((raw[i] > raw[i, token]).sum()))
            order = torch.sort(lp, descending=True, stable=True).indices[: min(num_top, raw.shape[1])]
            top_ids.append(order)
            top_lps.append(lp[order].float())
        result.logprobs = torch.tensor(chosen, dtype=torch.float32)
        result.ranks = torch.tensor(ranks, dtype=torch.int64)
        result.top_token_ids = torch.stack(top_ids)
        result.top_logprobs = torch.stack(top_lps)


if TYPE_CHECKING:
    _check: type[Sampler] = NaiveSampler
