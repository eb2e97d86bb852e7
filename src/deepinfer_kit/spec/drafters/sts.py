"""Sequential Temperature Scaling: per-position temperatures that calibrate a drafter's
cumulative survival probabilities left to right (each chosen for the lowest expected
calibration error of the survival, as the DSpark paper does), and that error.

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
_GRID_FINE = torch.exp(torch.linspace(-3.0, 3.0, 601, dtype=torch.float64))  # steps of 1%


def survival(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``[N, γ]`` raw logits and ``[γ]`` temperatures -> ``[N, γ]`` survival ``a_k``."""
    return torch.cumprod(torch.sigmoid(logits.double() / temperature.double()), dim=1)


def fit_sts(logits: torch.Tensor, accepted: torch.Tensor, *, objective: str = "ece",
            bins: int = 10, ece_tolerance: float = 1e-3) -> torch.Tensor:
    """Fit ``T_k`` one position at a time, left to right, with ``a_{k-1}`` already calibrated
    by ``T_0..T_{k-1}``: ``T_k`` minimises the calibration error of the cumulative survival
    ``a_k = a_{k-1}·σ(logit_k / T_k)`` against ``accepted[:, k]``.

    ``objective="ece"`` (the DSpark paper's Sequential Temperature Scaling): a 1-D grid
    search over ``log T`` in ``[-3, 3]`` for the lowest :func:`expected_calibration_error`
    (``bins`` bins). A binned error is flat across a range of temperatures: of those within
    ``ece_tolerance`` of the lowest, the one whose mean survival is nearest the mean target
    is taken (the planner sums survivals, so their mean matters). ``objective="nll"``: the binary
    log-loss, grid then golden-section refinement. ``accepted`` may hold soft targets in
    ``[0, 1]`` (expected survivals) as well as 0/1 events.

    Args:
        logits: ``[N, γ]`` raw confidence logits (CPU).
        accepted: ``[N, γ]`` survival events or expected survivals (CPU).

    Returns:
        ``[γ]`` float32 temperatures. Pure (no state).

    Raises:
        ValueError: shapes differ, ``N == 0`` or an unknown ``objective``.
    """
    if logits.shape != accepted.shape or logits.dim() != 2 or logits.shape[0] == 0:
        raise ValueError(f"fit_sts needs equal [N, γ] shapes with N >= 1, got "
                         f"{list(logits.shape)} and {list(accepted.shape)}")
    if objective not in ("ece", "nll"):
        raise ValueError(f"fit_sts objective must be 'ece' or 'nll', got {objective!r}")
    x, y = logits.double(), accepted.double()
    prior = torch.ones(x.shape[0], dtype=torch.float64)
    temps: list[float] = []
    for k in range(x.shape[1]):
        def nll(t: float, k: int = k) -> float:
            a = (prior * torch.sigmoid(x[:, k] / t)).clamp(1e-9, 1 - 1e-9)
            return float(-(y[:, k] * a.log() + (1 - y[:, k]) * (1 - a).log()).mean())

        def ece(t: float, k: int = k) -> float:
            return expected_calibration_error(prior * torch.sigmoid(x[:, k] / t), y[:, k], bins)

        if objective == "ece":
            losses = torch.tensor([ece(float(t)) for t in _GRID_FINE])
            near = torch.nonzero(losses <= float(losses.min()) + ece_tolerance).squeeze(1)
            bias = torch.tensor([abs(float((prior * torch.sigmoid(x[:, k] / _GRID_FINE[i])).mean()
                                           - y[:, k].mean())) for i in near.tolist()])
            temps.append(float(_GRID_FINE[near[int(bias.argmin())]]))
        else:
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
    """ECE of predicted probabilities ``[N]`` against 0/1 events (or expected values in
    ``[0, 1]``) ``[N]``: the sample-weighted mean, over ``bins`` equal-width bins, of
    ``|mean(prob) - mean(event)|``. Pure; O(N), vectorised."""
    p, e = prob.double().flatten(), event.double().flatten()
    which = (p * bins).long().clamp(0, bins - 1)
    count = torch.bincount(which, minlength=bins).double()
    sum_p = torch.bincount(which, weights=p, minlength=bins)
    sum_e = torch.bincount(which, weights=e, minlength=bins)
    # per bin: count * |mean p - mean e| = |sum p - sum e|
    return float((sum_p - sum_e).abs().sum()) / max(p.numel(), 1) if count.sum() else 0.0
