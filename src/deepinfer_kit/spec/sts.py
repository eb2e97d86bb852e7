"""Sequential Temperature Scaling: per-position temperatures that calibrate a drafter's
cumulative survival probabilities left to right, and the calibration error they are judged by.

Shapes: ``N`` samples (draft blocks), ``γ`` positions. ``logits[n, k]`` is the raw confidence
logit of draft ``k`` of block ``n``; ``accepted[n, k]`` is 1 when drafts ``0..k`` of the block
were all accepted (so each row is non-increasing). With temperatures ``T``, the conditional
confidence is ``c_k = σ(logit_k / T_k)`` and the survival ``a_k = Π_{i<=k} c_i``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["survival", "fit_sts", "expected_calibration_error"]

_GRID = torch.exp(torch.linspace(-3.0, 3.0, 241, dtype=torch.float64))  # T in [0.05, 20]


def survival(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``[N, γ]`` raw logits and ``[γ]`` temperatures -> ``[N, γ]`` survival ``a_k``."""
    return torch.cumprod(torch.sigmoid(logits.double() / temperature.double()), dim=1)


def fit_sts(logits: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """Fit ``T_k`` one position at a time, left to right: ``T_k`` minimises the binary NLL of
    ``a_k = a_{k-1}·σ(logit_k / T_k)`` against ``accepted[:, k]``, with ``a_{k-1}`` already
    calibrated by ``T_0..T_{k-1}`` (a grid over ``log T`` in ``[-3, 3]``, then a golden-section
    refinement around the best point).

    Args:
        logits: ``[N, γ]`` raw confidence logits (CPU).
        accepted: ``[N, γ]`` 0/1 survival events (CPU).

    Returns:
        ``[γ]`` float32 temperatures. Pure (no state).

    Raises:
        ValueError: shapes differ or ``N == 0``.
    """
    if logits.shape != accepted.shape or logits.dim() != 2 or logits.shape[0] == 0:
        raise ValueError(f"fit_sts needs equal [N, γ] shapes with N >= 1, got "
                         f"{list(logits.shape)} and {list(accepted.shape)}")
    x, y = logits.double(), accepted.double()
    prior = torch.ones(x.shape[0], dtype=torch.float64)
    temps: list[float] = []
    for k in range(x.shape[1]):
        def nll(t: float, k: int = k) -> float:
            a = (prior * torch.sigmoid(x[:, k] / t)).clamp(1e-9, 1 - 1e-9)
            return float(-(y[:, k] * a.log() + (1 - y[:, k]) * (1 - a).log()).mean())

        losses = torch.tensor([nll(float(t)) for t in _GRID])
        best = int(losses.argmin())
        lo = float(_GRID[max(best - 1, 0)].log())
        hi = float(_GRID[min(best + 1, len(_GRID) - 1)].log())
        t_best = _golden(lambda s: nll(float(torch.tensor(s).exp())), lo, hi)
        temps.append(float(torch.tensor(t_best).exp()))
        prior = prior * torch.sigmoid(x[:, k] / temps[-1])
    return torch.tensor(temps, dtype=torch.float32)


def _golden(f: Callable[[float], float], lo: float, hi: float, steps: int = 40) -> float:
    ratio = (5 ** 0.5 - 1) / 2
    a, b = lo, hi
    for _ in range(steps):
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        if f(c) < f(d):
            b = d
        else:
            a = c
    return (a + b) / 2


def expected_calibration_error(prob: torch.Tensor, event: torch.Tensor, bins: int = 10) -> float:
    """ECE of predicted probabilities ``[N]`` against 0/1 events ``[N]``: the sample-weighted
    mean, over ``bins`` equal-width bins, of ``|mean(prob) - mean(event)|``. Pure."""
    p, e = prob.double().flatten(), event.double().flatten()
    which = (p * bins).long().clamp(0, bins - 1)
    total = 0.0
    for b in range(bins):
        mask = which == b
        if bool(mask.any()):
            total += float(mask.sum()) * abs(float(p[mask].mean()) - float(e[mask].mean()))
    return total / max(p.numel(), 1)
