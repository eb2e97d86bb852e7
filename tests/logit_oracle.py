"""The per-row oracle of the logit stage (``logit_bias``, ``bad_words``,
``allowed_token_ids``), shared by the sampler's and the engine's tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer_kit.sample.params import SamplingParams


def reference_row(logits: torch.Tensor, p: SamplingParams, history: Sequence[int]) -> torch.Tensor:
    """One row edited the obvious way: add each bias, ban each word whose prefix ends the
    history, keep only the allowed tokens."""
    x = logits.clone()
    for token, bias in (p.logit_bias or {}).items():
        x[token] += bias
    for word in p.bad_words_token_ids:
        prefix = list(word[:-1])
        if not prefix or (len(history) >= len(prefix) and list(history)[-len(prefix):] == prefix):
            x[word[-1]] = float("-inf")
    if p.allowed_token_ids is not None:
        keep = torch.zeros_like(x, dtype=torch.bool)
        keep[list(p.allowed_token_ids)] = True
        x[~keep] = float("-inf")
    return x
