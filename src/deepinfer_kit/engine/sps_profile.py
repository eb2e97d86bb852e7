"""SPS profiling: time the runner's forward at a few batch-token counts when the engine is
built and fit the ``SpsCurve`` the DSpark planner maximises ``τ · SPS(B)`` with."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from deepinfer_kit.engine.runner import ModelRunner
from deepinfer_kit.engine.warmup import dummy_forward
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.spec.records import SpsCurve

__all__ = ["sps_points", "verify_shape", "fit_sps", "measure_sps", "forward_timer"]

_CONTEXT = 64  # context tokens of each profiled request (a short decode's)


def sps_points(max_tokens: int, *, cap: int = 256) -> list[int]:
    """The batch-token counts profiled: powers of two from 1 up to
    ``min(max_tokens, cap)``, and that bound itself. Pure."""
    top = max(1, min(max_tokens, cap))
    points = [1]
    while points[-1] * 2 <= top:
        points.append(points[-1] * 2)
    if points[-1] != top:
        points.append(top)
    return points


def verify_shape(tokens: int, chunk: int, context: int = _CONTEXT) -> tuple[list[int], list[int]]:
    """``(query_lens, seq_lens)`` of a verify round of ``tokens`` tokens: requests of at
    most ``chunk`` tokens (``1 + γ``), each after ``context`` cached tokens. Pure."""
    num_req = -(-tokens // chunk)
    base, extra = divmod(tokens, num_req)
    query = [base + (r < extra) for r in range(num_req)]
    return query, [context + q for q in query]


def fit_sps(batch_tokens: Sequence[int], seconds: Sequence[Sequence[float]]) -> SpsCurve:
    """The curve of measured step times: the median of each point's repeats, made
    non-decreasing in ``B`` (a larger step is never faster: a dip is timing noise), then
    ``SPS = 1 / seconds``. Pure.

    Args:
        batch_tokens: increasing token counts ``B``.
        seconds: per count, the step times measured (at least one each, all > 0).

    Raises:
        ConfigError: counts and timings that disagree, or a time that is not > 0.
    """
    if len(batch_tokens) != len(seconds) or any(not s for s in seconds):
        raise ConfigError(f"fit_sps needs timings for each of {list(batch_tokens)}, got {seconds}")
    curve: list[float] = []
    for times in seconds:
        t = statistics.median(times)
        if not t > 0:
            raise ConfigError(f"fit_sps needs step times > 0, got {list(times)}")
        curve.append(max(t, curve[-1]) if curve else t)
    return SpsCurve(tuple(batch_tokens), tuple(1.0 / t for t in curve))


def measure_sps(time_step: Callable[[int], float], batch_tokens: Sequence[int], *,
                repeats: int = 3) -> SpsCurve:
    """Time ``time_step(B)`` (seconds of one step of ``B`` tokens) ``repeats`` times per
    count after one untimed call, and fit the curve (:func:`fit_sps`)."""
    seconds = []
    for b in batch_tokens:
        time_step(b)  # first touch: allocations, kernel selection
        seconds.append([time_step(b) for _ in range(repeats)])
    return fit_sps(batch_tokens, seconds)


def forward_timer(runner: ModelRunner, chunk: int, *, context: int = _CONTEXT,
                  clock: Callable[[], float] = time.perf_counter) -> Callable[[int], float]:
    """``B -> seconds`` of one forward of the runner's model over a verify round of ``B``
    tokens (:func:`verify_shape` with ``chunk = 1 + γ`` and ``context``), synchronised on
    CUDA.

    Each call runs :func:`~deepinfer_kit.engine.warmup.dummy_forward`: it writes only the
    KV pool's pad slot, so it may run before the engine serves, never during a round.
    ``clock`` is read before and after (tests pass a fake one).
    """

    def run(tokens: int) -> float:
        query, seq = verify_shape(tokens, chunk, context)
        start = clock()
        dummy_forward(runner, query, seq)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        return clock() - start

    return run
