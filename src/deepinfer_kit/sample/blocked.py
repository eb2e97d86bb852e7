"""Blocked row reductions shared by the sampler's torch ops: a row is reduced in fixed
slices of ``BLOCK`` tokens, so its arithmetic never depends on the rows beside it."""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["BLOCK", "blocked_reduce"]

BLOCK = 1024
"""Tokens per block of the blocked row sums (and of the Triton kernels' chunks)."""


def blocked_reduce(t: torch.Tensor, block: int, how: Literal["sum", "amax"]) -> torch.Tensor:
    """``[n, ceil(V / block)]`` sums or maxima of consecutive ``block``-token slices of
    ``t [n, V]`` (the last slice may be shorter); each slice is reduced on its own, so the
    result for a row does not depend on the other rows."""
    n, vocab = t.shape
    full = vocab // block
    parts = []
    if full:
        parts.append(getattr(t[:, : full * block].reshape(n, full, block), how)(dim=-1))
    if vocab > full * block:
        parts.append(getattr(t[:, full * block :], how)(dim=-1, keepdim=True))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
