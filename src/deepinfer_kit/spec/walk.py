"""The DSpark planner's candidate walk: every candidate ``(r, j)`` of positive survival,
ranked (decreasing survival; ties: earlier ``j``, then lower ``r``), the ``Θ`` of verifying
the first ``k`` for every ``k`` at once, and the lengths of a top-``k`` selection.

Two equal implementations, chosen per walk by its size: plain Python for a few candidates
(a round of one request: tens of microseconds, where tensor calls cost hundreds) and CPU
tensors past :data:`VECTORISE_FROM` candidates (256 x 8 per round: milliseconds in Python).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer_kit.spec.records import SpsCurve

__all__ = ["Walk", "step_times", "VECTORISE_FROM"]

VECTORISE_FROM = 96
"""Candidate slots (``R`` x widest row) from which the walk runs on tensors."""


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
        vectorise: run on tensors; ``None``: when ``R`` x the widest row reaches
            :data:`VECTORISE_FROM`.

    Attributes:
        survival: the survivals in walk order (all > 0): a float64 tensor or a list.
        rows: the request of each candidate, in walk order (an int64 tensor or a list).
        num_requests: ``R``.
    """

    def __init__(self, confidence: Sequence[Sequence[float]], max_lengths: Sequence[int],
                 vectorise: bool | None = None) -> None:
        num_req = len(max_lengths)
        width = max((min(len(c), m) for c, m in zip(confidence, max_lengths)), default=0)
        self.num_requests = num_req
        self.vectorised = num_req * width >= VECTORISE_FROM if vectorise is None else vectorise
        self.survival: torch.Tensor | list[float]
        self.rows: torch.Tensor | list[int]
        if not self.vectorised:
            ranked: list[tuple[float, int, int]] = []
            for r, (conf, m) in enumerate(zip(confidence, max_lengths)):
                a = 1.0
                for j, c in enumerate(conf[:m]):
                    a *= min(1.0, max(0.0, float(c)))
                    if a > 0.0:
                        ranked.append((-a, j, r))
            ranked.sort()
            self.survival = [-x[0] for x in ranked]
            self.rows = [x[2] for x in ranked]
            return
        if width <= 0:
            self.survival = torch.zeros(0, dtype=torch.float64)
            self.rows = torch.zeros(0, dtype=torch.int64)
            return
        padded = [list(c[:width]) + [0.0] * (width - len(c[:width])) for c in confidence]
        conf_t = torch.tensor(padded, dtype=torch.float64).clamp_(0.0, 1.0)
        limit = torch.tensor(list(max_lengths), dtype=torch.int64).unsqueeze(1)
        keep = torch.arange(width).unsqueeze(0) < limit
        a_t = torch.cumprod(conf_t, dim=1).mul_(keep)
        flat = a_t.t().reshape(-1)  # position-major: index j * R + r, the tie order
        order = torch.argsort(flat, descending=True, stable=True)
        ranked_t = flat[order]
        count = int((ranked_t > 0).sum())
        self.survival = ranked_t[:count]
        self.rows = order[:count] % num_req

    @classmethod
    def ranked(cls, survivals: Sequence[float], num_requests: int) -> Walk:
        """A walk over survivals already ranked (positive, decreasing), of ``num_requests``
        requests; its :meth:`lengths` are not defined (no rows)."""
        walk = cls([], [], vectorise=len(survivals) >= VECTORISE_FROM)
        walk.survival = (torch.tensor(list(survivals), dtype=torch.float64) if walk.vectorised
                         else [float(a) for a in survivals])
        walk.num_requests = num_requests
        return walk

    def __len__(self) -> int:
        return len(self.survival)

    def best(self, sps: SpsCurve, other_tokens: int, *, early_stop: bool = False) -> int:
        """The ``k`` of the largest ``Θ`` (``DSparkPlanner``'s objective) of verifying the
        first ``k`` candidates in a round with ``other_tokens`` prefill tokens: over the
        whole walk, the first of equal maxima; ``early_stop``: the last ``k`` before the
        first that does not raise ``Θ``."""
        num_req, other = self.num_requests, max(0, other_tokens)
        prefill_s = sps.step_time(num_req + other) - sps.step_time(num_req) if other else 0.0
        if self.vectorised:
            assert isinstance(self.survival, torch.Tensor)
            taus = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(self.survival, 0)]).add_(num_req)
            counts = torch.arange(len(self) + 1, dtype=torch.int64).add_(num_req + other)
            theta = taus / (step_times(sps, counts) - prefill_s)
            if not early_stop:
                return int(torch.argmax(theta))
            rises = (theta[1:] > theta[:-1]).tolist()
            return rises.index(False) if False in rises else len(rises)
        tokens, tau = num_req + other, float(num_req)
        best_k, best = 0, tau / (sps.step_time(tokens) - prefill_s)
        for k, a in enumerate(self.survival, start=1):
            tau += a
            theta_k = tau / (sps.step_time(tokens + k) - prefill_s)
            if theta_k > best:
                best_k, best = k, theta_k
            elif early_stop:
                break
        return best_k

    def lengths(self, count: int) -> list[int]:
        """``[R]`` drafts per request among the first ``count`` candidates (a prefix of
        each request's drafts: the ranking keeps them in order)."""
        count = max(0, count)
        if isinstance(self.rows, torch.Tensor):
            return torch.bincount(self.rows[:count], minlength=self.num_requests).tolist()
        out = [0] * self.num_requests
        for r in self.rows[:count]:
            out[r] += 1
        return out

