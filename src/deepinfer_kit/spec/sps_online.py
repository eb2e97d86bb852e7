"""MeasuredSps: a profiled SPS curve corrected online from the step times an engine
measures — per profiled count, the median ratio of measured to profiled time over a
sliding window — so that a planner trades drafts against what rounds cost now (the
sampler and the verifier included, a context that grew, a device that throttles)."""

from __future__ import annotations

import bisect
import statistics
from collections import deque

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.spec.records import SpsCurve

__all__ = ["MeasuredSps"]


class MeasuredSps:
    """The curve ``base`` with each profiled count's time scaled by what rounds of that
    size measured.

    A round of ``B`` tokens measured at ``s`` seconds is a sample ``s / base.step_time(B)``
    of the count it falls to: the smallest profiled count ``>= B`` (the last one past the
    end of the curve). Each count keeps its last ``window`` samples; once it holds
    ``min_samples``, its time is scaled by their median (a median: one round stalled by the
    host or a compile does not move it; DeepInfer's sampler estimate uses the same window
    of 9 and threshold of 5). Counts without enough samples keep the profiled time; the
    corrected times are then made non-decreasing in ``B`` (a count corrected upwards lifts
    the larger ones it would otherwise overtake).

    Args:
        base: the profiled curve (its reading, linear or staircase, is kept).
        window: samples kept per count.
        min_samples: samples a count needs before its correction applies.

    Raises:
        ConfigError: ``window`` < 1 or ``min_samples`` not in ``[1, window]``.
    """

    def __init__(self, base: SpsCurve, *, window: int = 9, min_samples: int = 5) -> None:
        if window < 1 or not 1 <= min_samples <= window:
            raise ConfigError(f"MeasuredSps needs window >= 1 and 1 <= min_samples <= window, "
                              f"got window={window}, min_samples={min_samples}")
        self.base = base
        self.window = window
        self.min_samples = min_samples
        self._samples: dict[int, deque[float]] = {}
        self._ratios = [1.0] * len(base.batch_tokens)
        self._curve = base

    @property
    def curve(self) -> SpsCurve:
        """The corrected curve (``base`` until a count has ``min_samples`` samples)."""
        return self._curve

    def ratios(self) -> list[float]:
        """Per profiled count, the factor its profiled time is scaled by (1.0: none yet)."""
        return list(self._ratios)

    def observe(self, tokens: int, seconds: float) -> bool:
        """Record a round of ``tokens`` tokens that took ``seconds``; returns whether the
        corrected curve changed. Ignores a non-positive or non-finite time or count.
        Called by the runner after each speculative round; O(window log window + counts)."""
        if not (tokens > 0 and 0.0 < seconds < float("inf")):
            return False
        xs = self.base.batch_tokens
        i = min(bisect.bisect_left(xs, tokens), len(xs) - 1)
        samples = self._samples.setdefault(i, deque(maxlen=self.window))
        samples.append(seconds / self.base.step_time(tokens))
        if len(samples) < self.min_samples:
            return False
        ratio = statistics.median(samples)
        if ratio == self._ratios[i]:
            return False
        self._ratios[i] = ratio
        times: list[float] = []
        for t, r in zip(self.base.times, self._ratios):
            times.append(max(t * r, times[-1]) if times else t * r)
        self._curve = SpsCurve(xs, tuple(1.0 / t for t in times), staircase=self.base.staircase)
        return True
