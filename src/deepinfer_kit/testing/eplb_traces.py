"""Synthetic expert-load traces for EPLB tests and benchmarks: drifting Zipf popularity, as
windows of totals or as windows of per-step counts (stationary, drifting, bursty, prefill /
decode alternation)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from deepinfer_kit._validators import require_ints_at_least
from deepinfer_kit.eplb.zipf import ZipfDrift
from deepinfer_kit.errors import ConfigError

__all__ = ["drifting_zipf_trace", "drifting_zipf_foresight", "step_windows", "STEP_KINDS"]

STEP_KINDS = ("stationary", "drifting", "bursty", "prefill-decode")


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

    The popularity is a :class:`~deepinfer_kit.eplb.zipf.ZipfDrift` (Zipf log-weights over
    a random permutation of each layer's experts, an AR(1) step between windows, so
    consecutive windows' log-weights correlate ~``correlation``). A window's counts are
    Poisson with mean ``tokens_per_window`` times the popularity. Deterministic in ``seed``.

    Raises:
        ConfigError: a count below 1, ``correlation`` outside [0, 1] or ``exponent`` < 0.
    """
    return [counts for counts, _ in _walk(num_windows, num_layers, num_experts, exponent, correlation,
                                          tokens_per_window, seed)]


def drifting_zipf_foresight(
    num_windows: int,
    num_layers: int,
    num_experts: int,
    *,
    exponent: float = 1.0,
    correlation: float = 0.98,
    tokens_per_window: int = 1 << 16,
    seed: int = 0,
) -> list[torch.Tensor]:
    """What a perfect forecaster knows after each window of :func:`drifting_zipf_trace`
    (same arguments, same seed): ``T`` ``[L, E]`` float64 loads ``tokens_per_window *
    softmax(correlation * z_t)``, the hidden log-weights ``z_t`` of window ``t`` carried one
    AR(1) step forward without the unknowable noise. Planning from entry ``t`` instead of
    window ``t`` bounds what forecasting can gain on the next window.

    Raises:
        ConfigError: as :func:`drifting_zipf_trace`.
    """
    return [ahead for _, ahead in _walk(num_windows, num_layers, num_experts, exponent, correlation,
                                        tokens_per_window, seed)]


def _walk(num_windows: int, num_layers: int, num_experts: int, exponent: float, correlation: float,
          tokens_per_window: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(counts, foresight)`` per window; the foresight draws no random numbers, so
    the counts do not depend on whether it is used."""
    require_ints_at_least(
        1, num_windows=num_windows, num_layers=num_layers, num_experts=num_experts,
        tokens_per_window=tokens_per_window,
    )
    gen = torch.Generator().manual_seed(seed)
    popularity = ZipfDrift(num_layers, num_experts, exponent=exponent, correlation=correlation,
                           generator=gen)
    for _ in range(num_windows):
        rate = popularity.probabilities() * tokens_per_window
        counts = torch.poisson(rate, generator=gen).to(torch.int64)
        ahead = torch.softmax(correlation * popularity.log_weights, dim=1) * tokens_per_window
        yield counts, ahead
        popularity.drift()


def step_windows(
    kind: str,
    num_windows: int,
    num_layers: int,
    num_experts: int,
    *,
    steps: int = 64,
    tokens: int = 4096,
    top_k: int = 8,
    exponent: float = 0.6,
    correlation: float = 0.999,
    seed: int = 0,
) -> list[torch.Tensor]:
    """``T`` windows of ``[S, L, E]`` int64 per-step counts (CPU), one process across them
    (window ``t + 1`` continues where ``t`` stopped), deterministic in ``seed``.

    Every step routes ``tokens * top_k`` copies per layer on average (Poisson counts of the
    step's popularity); popularities are :class:`~deepinfer_kit.eplb.zipf.ZipfDrift` Zipf
    laws with ``exponent`` over a random permutation of each layer's experts.

    - ``"stationary"``: one popularity throughout;
    - ``"drifting"``: one popularity taking an AR(1) step (``correlation``) every step;
    - ``"bursty"``: two independent popularities, each step drawing one of them at random
      (equal odds; every layer of a step the same one);
    - ``"prefill-decode"``: two independent popularities alternating, a large step
      (``4 * tokens``) of the first and a small one (``tokens / 8``) of the second.

    Raises:
        ConfigError: an unknown ``kind`` or a count below 1.
    """
    if kind not in STEP_KINDS:
        raise ConfigError(f"kind must be one of {list(STEP_KINDS)}, got {kind!r}")
    require_ints_at_least(1, num_windows=num_windows, num_layers=num_layers, num_experts=num_experts,
                          steps=steps, tokens=tokens, top_k=top_k)
    gen = torch.Generator().manual_seed(seed)
    first, second = (ZipfDrift(num_layers, num_experts, exponent=exponent, correlation=correlation, generator=gen)
                     for _ in range(2))
    out = []
    for _ in range(num_windows):
        rows = []
        for s in range(steps):
            pick, size = first, tokens
            if kind == "drifting":
                first.drift()
            elif kind == "bursty" and bool(torch.rand((), generator=gen) < 0.5):
                pick = second
            elif kind == "prefill-decode":
                pick, size = (first, 4 * tokens) if s % 2 == 0 else (second, max(tokens // 8, 1))
            rows.append(torch.poisson(pick.probabilities() * (size * top_k), generator=gen))
        out.append(torch.stack(rows).to(torch.int64))
    return out
