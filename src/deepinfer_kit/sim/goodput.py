"""Goodput: how many requests met both latency targets (time to first token and time per
output token), as a fraction of the requests and as a rate."""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.outputs import RequestOutput

__all__ = ["RequestLatency", "Goodput", "latency_of", "goodput"]


@attrs.frozen(slots=True)
class RequestLatency:
    """The two latencies an SLO bounds, of one request (seconds).

    Attributes:
        ttft_s: arrival to first token; ``None`` when no token came (an error, or not
            finished).
        tpot_s: first token to finish over ``output tokens - 1``; ``None`` for a request
            of one output token (it has no time per output token) or without a token.
    """

    ttft_s: float | None
    tpot_s: float | None


def latency_of(out: RequestOutput) -> RequestLatency:
    """The :class:`RequestLatency` of a finished request's output, as
    :class:`~deepinfer_kit.sim.metrics.MetricsRecorder` measures TTFT and TPOT (``None``
    where it records no sample: an ``error`` finish, missing times, one token). Pure."""
    comp = out.outputs[0]
    m = out.metrics
    if comp.finish_reason == "error" or m is None or m.first_token_time is None:
        return RequestLatency(None, None)
    ttft = m.first_token_time - m.arrival_time
    n = len(comp.token_ids)
    if m.finished_time is None or n < 2:
        return RequestLatency(ttft, None)
    return RequestLatency(ttft, (m.finished_time - m.first_token_time) / (n - 1))


@attrs.frozen(slots=True)
class Goodput:
    """Requests that met both targets.

    Attributes:
        ttft_slo_s, tpot_slo_s: the targets (seconds).
        num_requests: requests counted (the denominator).
        num_good: those with ``ttft <= ttft_slo_s`` and ``tpot <= tpot_slo_s``.
        fraction: ``num_good / num_requests`` (0.0 for no request).
        rate_per_s: ``num_good / duration_s`` (good requests per second; 0.0 for no
            duration).
    """

    ttft_slo_s: float
    tpot_slo_s: float
    num_requests: int
    num_good: int
    fraction: float
    rate_per_s: float


def goodput(latencies: Sequence[RequestLatency], ttft_slo_s: float, tpot_slo_s: float,
            duration_s: float, num_requests: int | None = None) -> Goodput:
    """Goodput of a run: the requests whose TTFT is at most ``ttft_slo_s`` AND whose
    TPOT is at most ``tpot_slo_s``, as a fraction of ``num_requests`` (default
    ``len(latencies)``; pass the arrivals to count requests that never finished as
    misses) and as a rate over ``duration_s`` (the run's span, e.g.
    :attr:`SimReport.duration_s`).

    A request without a first token misses; one of a single output token (TPOT
    ``None``) is judged by its TTFT alone. Pure; O(len(latencies)).

    Raises:
        ConfigError: an SLO that is not > 0, ``duration_s`` < 0 or NaN, or
            ``num_requests`` smaller than ``len(latencies)`` (names the argument and
            its value).
    """
    for name, value in (("ttft_slo_s", ttft_slo_s), ("tpot_slo_s", tpot_slo_s)):
        if not value > 0:
            raise ConfigError(f"{name} must be > 0, got {value!r}")
    if not duration_s >= 0 or math.isnan(duration_s):
        raise ConfigError(f"duration_s must be >= 0, got {duration_s!r}")
    total = len(latencies) if num_requests is None else num_requests
    if total < len(latencies):
        raise ConfigError(f"num_requests must be >= {len(latencies)} (the latencies given), got {total}")
    good = 0
    for lat in latencies:
        if lat.ttft_s is None or lat.ttft_s > ttft_slo_s:
            continue
        if lat.tpot_s is None or lat.tpot_s <= tpot_slo_s:
            good += 1
    return Goodput(ttft_slo_s, tpot_slo_s, total, good, good / total if total else 0.0,
                   good / duration_s if duration_s > 0 else 0.0)
