"""The DSpark planner's candidate walk on CPU tensors: every candidate ``(r, j)`` of
positive survival, ranked (decreasing survival; ties: earlier ``j``, then lower ``r``), the
expected tokens and step time of verifying the first ``k`` for every ``k`` at once, and the
lengths of a top-``k`` selection. A few vectorised calls instead of a Python loop over up
to ``R · γ`` candidates (256 x 8 per round: milliseconds in Python)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer_kit.spec.records import SpsCurve

__all__ = ["Walk", "step_times"]


def step_times(sps: SpsCurve, tokens: torch.Tensor) -> torch.Tensor:
    """``sps.step_time`` at each count of ``tokens`` (int64, CPU) as float64, the same
    reading (staircase or linear, the first point's time below it, the last segment's
    slope past it). Pure."""
    xs = torch.tensor(sps.batch_tokens, dtype=torch.int64)
    ts = torch.tensor(sps.times, dtype=torch.float64)
    n = xs.numel()
    i = torch.searchsorted(xs, tokens).clamp_(max=n - 1)
    out = ts[i]
    if n > 1:
        if not sps.staircase:
            lo = (i - 1).clamp_(min=0)
            span = (xs[i] - xs[lo]).to(torch.float64).clamp_(min=1.0)
            frac = (tokens - xs[lo]).to(torch.float64) / span
            inner = (tokens > xs[0]) & (tokens <= xs[-1])
            out = torch.where(inner, ts[lo] + frac * (ts[i] - ts[lo]), out)
        slope = max(0.0, (sps.times[-1] - sps.times[-2]) / (sps.batch_tokens[-1] - sps.batch_tokens[-2]))
        past = tokens > xs[-1]
        out = torch.where(past, ts[-1] + slope * (tokens - xs[-1]).to(torch.float64), out)
    return torch.where(tokens <= xs[0], ts[0], out)


class Walk:
    """The ranked candidates of one round's confidences.

    Args:
        confidence: ``[R][*]`` per-position confidences (clamped to ``[0, 1]``).
        max_lengths: ``[R]`` drafts available: request ``r``'s candidates are its first
            ``max_lengths[r]`` positions (a shorter row has fewer).

    Attributes:
        survival: ``[C]`` float64 survivals in walk order (all > 0).
        rows: ``[C]`` int64 request of each candidate.
        num_requests: ``R``.
    """

    def __init__(self, confidence: Sequence[Sequence[float]], max_lengths: Sequence[int]) -> None:
        num_req = len(max_lengths)
        width = max((min(len(c), m) for c, m in zip(confidence, max_lengths)), default=0)
        self.num_requests = num_req
        if width <= 0:
            self.survival = torch.zeros(0, dtype=torch.float64)
            self.rows = torch.zeros(0, dtype=torch.int64)
            return
        padded = [list(c[:width]) + [0.0] * (width - len(c[:width])) for c in confidence]
        conf = torch.tensor(padded, dtype=torch.float64).clamp_(0.0, 1.0)
        limit = torch.tensor(list(max_lengths), dtype=torch.int64).unsqueeze(1)
        keep = torch.arange(width).unsqueeze(0) < limit
        a = torch.cumprod(conf, dim=1).mul_(keep)
        flat = a.t().reshape(-1)  # position-major: index j * R + r, the tie order
        order = torch.argsort(flat, descending=True, stable=True)
        ranked = flat[order]
        count = int((ranked > 0).sum())
        self.survival = ranked[:count]
        self.rows = order[:count] % num_req

    @classmethod
    def ranked(cls, survivals: Sequence[float], num_requests: int) -> Walk:
        """A walk over survivals already ranked (positive, decreasing), of ``num_requests``
        requests; its :meth:`lengths` are not defined (no rows)."""
        walk = cls([], [])
        walk.survival = torch.tensor(list(survivals), dtype=torch.float64)
        walk.num_requests = num_requests
        return walk

    def __len__(self) -> int:
        return int(self.survival.numel())

    def theta(self, sps: SpsCurve, other_tokens: int) -> torch.Tensor:
        """``[C + 1]`` float64 ``Θ`` of verifying the first ``k`` candidates, ``k = 0..C``,
        in a round with ``other_tokens`` prefill tokens (``DSparkPlanner``'s objective)."""
        num_req, other = self.num_requests, max(0, other_tokens)
        tau = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(self.survival, 0)]).add_(num_req)
        tokens = torch.arange(len(self) + 1, dtype=torch.int64).add_(num_req + other)
        prefill_s = sps.step_time(num_req + other) - sps.step_time(num_req) if other else 0.0
        return tau / (step_times(sps, tokens) - prefill_s)

    def lengths(self, count: int) -> list[int]:
        """``[R]`` drafts per request among the first ``count`` candidates (a prefix of
        each request's drafts: the ranking keeps them in order)."""
        rows = self.rows[: max(0, count)]
        return torch.bincount(rows, minlength=self.num_requests).tolist()
