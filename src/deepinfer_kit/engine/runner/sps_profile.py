"""SPS profiling: time the runner's forward over the whole range of batch-token counts a
round can hold when the engine is built — powers of two up to the token budget, then more
points bisecting the knee where the step stops being flat — and fit the ``SpsCurve`` the
DSpark planner maximises ``τ · SPS(B)`` with."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from deepinfer_kit.engine.runner.model_runner import ModelRunner
from deepinfer_kit.engine.runner.warmup import dummy_forward
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.spec.records import SpsCurve

__all__ = ["sps_points", "knee_interval", "verify_shape", "fit_sps", "measure_sps", "forward_timer"]

_CONTEXT = 64  # context tokens of each profiled request (a short decode's)


def sps_points(max_tokens: int) -> list[int]:
    """The batch-token counts profiled first: powers of two from 1 up to ``max_tokens``
    (the round's token budget), and that bound itself. Pure."""
    top = max(1, max_tokens)
    points = [1]
    while points[-1] * 2 <= top:
        points.append(points[-1] * 2)
    if points[-1] != top:
        points.append(top)
    return points


def knee_interval(batch_tokens: Sequence[int], seconds: Sequence[float], *,
                  rise: float = 1.25) -> tuple[int, int] | None:
    """The neighbouring counts ``(a, b)`` between which the step time first exceeds
    ``rise`` times the time of the smallest count — where the device stops being flat —
    or ``None`` when it never does or no count lies strictly between them. Pure."""
    base = seconds[0] * rise
    for i in range(1, len(batch_tokens)):
        if seconds[i] > base:
            a, b = batch_tokens[i - 1], batch_tokens[i]
            return (a, b) if b - a > 1 else None
    return None


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
                repeats: int = 3, refine: int = 4) -> SpsCurve:
    """Time ``time_step(B)`` (seconds of one step of ``B`` tokens) ``repeats`` times per
    count after one untimed call, then locate the knee: up to ``refine`` more counts, each
    bisecting the interval where the step time first rises (:func:`knee_interval`); fit
    the curve over all of them (:func:`fit_sps`)."""
    timed: dict[int, list[float]] = {}

    def measure(b: int) -> None:
        time_step(b)  # first touch: allocations, kernel selection
        timed[b] = [time_step(b) for _ in range(repeats)]

    for b in batch_tokens:
        measure(b)
    for _ in range(refine):
        xs = sorted(timed)
        knee = knee_interval(xs, [statistics.median(timed[b]) for b in xs])
        if knee is None:
            break
        measure((knee[0] + knee[1]) // 2)
    xs = sorted(timed)
    return fit_sps(xs, [timed[b] for b in xs])


def forward_timer(runner: ModelRunner, chunk: int, *, context: int = _CONTEXT,
                  clock: Callable[[], float] = time.perf_counter) -> Callable[[int], float]:
    """``B -> seconds`` of one forward of the runner's model over a verify round of ``B``
    tokens (:func:`verify_shape` with ``chunk = 1 + γ`` and ``context``), synchronised on
    CUDA.

    Each call runs :func:`~deepinfer_kit.engine.runner.warmup.dummy_forward`: it writes only the
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
