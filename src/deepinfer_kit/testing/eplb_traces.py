"""Synthetic expert-load traces for EPLB tests and benchmarks: drifting Zipf popularity."""

from __future__ import annotations

import math

import torch

from deepinfer_kit._validators import require_ints_at_least
from deepinfer_kit.errors import ConfigError

__all__ = ["drifting_zipf_trace"]


def drifting_zipf_trace(
    num_windows: int,
    num_layers: int,
    num_experts: int,
    *,
    exponent: float = 1.0,
    correlation: float = 0.98,
    tokens_per_window: int = 1 << 16,
    seed: int = 0,
) -> list[torch.Tensor]:
    """``T`` windows of ``[L, E]`` int64 token counts (CPU) from drifting Zipf popularity.

    Each layer starts from Zipf log-weights ``-exponent * log(rank)`` over a random
    permutation of its experts; between windows the centred log-weights follow an AR(1)
    step ``z' = c z + sqrt(1 - c^2) * std(z) * noise`` (consecutive windows' log-weights
    correlate ~``c``). A window's counts are Poisson with mean ``tokens_per_window`` times
    the softmax of ``z``. Deterministic in ``seed``.

    Raises:
        ConfigError: a count below 1, ``correlation`` outside [0, 1] or ``exponent`` < 0.
    """
    require_ints_at_least(
        1, num_windows=num_windows, num_layers=num_layers, num_experts=num_experts,
        tokens_per_window=tokens_per_window,
    )
    if not 0.0 <= correlation <= 1.0:
        raise ConfigError(f"correlation must be in [0, 1], got {correlation}")
    if not exponent >= 0.0:
        raise ConfigError(f"exponent must be >= 0, got {exponent}")
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.stack([torch.randperm(num_experts, generator=gen) for _ in range(num_layers)])
    z = -exponent * torch.log1p(ranks.double())
    z = z - z.mean(dim=1, keepdim=True)
    spread = z.std(dim=1, keepdim=True).clamp_min(1e-12) if num_experts > 1 else torch.ones(num_layers, 1)
    windows = []
    for _ in range(num_windows):
        rate = torch.softmax(z, dim=1) * tokens_per_window
        windows.append(torch.poisson(rate, generator=gen).to(torch.int64))
        noise = torch.randn(z.shape, generator=gen, dtype=torch.float64)
        z = correlation * z + math.sqrt(1.0 - correlation**2) * spread * noise
    return windows
