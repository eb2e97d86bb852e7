"""NgramDrafter: prompt lookup — continue the request's latest n-gram as it went before."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from deepinfer_kit._validators import require_ints_at_least
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.spec.protocols import DraftSequence
from deepinfer_kit.spec.records import DraftProposal

if TYPE_CHECKING:
    from deepinfer_kit.spec.protocols import Drafter

__all__ = ["NgramDrafter", "lookup"]


def lookup(tokens: Sequence[int], num_draft: int, min_n: int, max_n: int) -> tuple[list[int], list[float]]:
    """Drafts and confidences for one token sequence.

    For ``n`` from ``max_n`` down to ``min_n``: find the earlier occurrences of the last
    ``n`` tokens; if there are any, draft the up to ``num_draft`` tokens that followed the
    most recent one. The confidence of draft ``j`` is the smoothed share of occurrences
    whose continuation agreed with drafts ``0..j`` among those that agreed with drafts
    ``0..j-1``: ``(agree_j + 1) / (agree_{j-1} + 2)`` — a per-position estimate of
    acceptance given the previous drafts were accepted. O(len(tokens) * n).

    Returns:
        ``(drafts, confidence)``, equal lengths ``<= num_draft``; empty when no n-gram of
        the allowed sizes occurred before.
    """
    total = len(tokens)
    seq = list(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        pattern = seq[total - n :]
        first = pattern[0]
        starts: list[int] = []
        i = 0
        last_start = total - n - 1  # an occurrence must end before the suffix itself
        while True:
            try:
                i = seq.index(first, i, last_start + 1)
            except ValueError:
                break
            if seq[i : i + n] == pattern:
                starts.append(i + n)
            i += 1
        if not starts:
            continue
        newest = starts[-1]
        drafts = seq[newest : newest + num_draft]
        confidence: list[float] = []
        alive = starts
        for j, tok in enumerate(drafts):
            agree = [s for s in alive if s + j < total and seq[s + j] == tok]
            confidence.append((len(agree) + 1) / (len(alive) + 2))
            alive = agree
        return drafts, confidence
    return [], []


class NgramDrafter:
    """Drafts by prompt lookup over each request's own tokens (prompt and output).

    Deterministic, no model: ``draft_probs`` is ``None`` (one-hot), and each draft carries
    a confidence (see :func:`lookup`).

    Args:
        min_n, max_n: n-gram sizes tried, longest first (``1 <= min_n <= max_n``).

    Raises:
        ConfigError: ``min_n < 1`` or ``max_n < min_n``.
    """

    def __init__(self, min_n: int = 1, max_n: int = 3) -> None:
        require_ints_at_least(1, min_n=min_n, max_n=max_n)
        if max_n < min_n:
            raise ConfigError(f"max_n must be >= min_n ({min_n}), got {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: Sequence[DraftSequence], num_draft: int) -> DraftProposal:
        """Draft up to ``num_draft`` tokens per request; see :meth:`Drafter.propose`.

        Reads ``all_token_ids``; mutates nothing. O(sum of request lengths * max_n).

        Returns:
            ``token_ids [R, num_draft]`` int64 (padded with 0), ``confidence [R,
            num_draft]`` float32 (0 past ``num_drafted``), CPU tensors.
        """
        ids: list[list[int]] = []
        conf: list[list[float]] = []
        counts: list[int] = []
        for req in requests:
            drafts, c = lookup(req.all_token_ids, num_draft, self.min_n, self.max_n)
            counts.append(len(drafts))
            pad = num_draft - len(drafts)
            ids.append(drafts + [0] * pad)
            conf.append(c + [0.0] * pad)
        num_req = len(requests)
        return DraftProposal(
            token_ids=torch.tensor(ids, dtype=torch.int64).view(num_req, num_draft),
            num_drafted=counts,
            confidence=torch.tensor(conf, dtype=torch.float32).view(num_req, num_draft),
        )


if TYPE_CHECKING:
    _check: type[Drafter] = NgramDrafter
