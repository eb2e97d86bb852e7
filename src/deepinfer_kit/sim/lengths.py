"""LengthDist: a seeded distribution of token counts (prompt or output lengths)."""

from __future__ import annotations

import math
import random

import attrs

from deepinfer_kit._validators import int_at_least, one_of
from deepinfer_kit._validators import positive
from deepinfer_kit.errors import ConfigError

__all__ = ["LengthDist"]

_KINDS = ("fixed", "uniform", "exponential", "lognormal")


@attrs.frozen(slots=True)
class LengthDist:
    """Token counts clipped to ``[min_len, max_len]``.

    Attributes:
        kind: ``"fixed"`` (always ``mean``), ``"uniform"`` (in ``mean * (1 +- spread)``),
            ``"exponential"`` (mean ``mean``) or ``"lognormal"`` (mean ``mean``, log-space
            sigma ``spread``).
        mean: the mean before clipping.
        spread: see ``kind`` (ignored by fixed and exponential).
        min_len, max_len: the clip.

    Raises:
        ConfigError: an unknown kind, ``mean <= 0``, ``spread < 0``, or
            ``min_len > max_len``.
    """

    kind: str = attrs.field(default="lognormal", validator=one_of(_KINDS))
    mean: float = attrs.field(default=500.0, validator=positive)
    spread: float = 0.5
    min_len: int = attrs.field(default=1, validator=int_at_least(1))
    max_len: int = attrs.field(default=1 << 20, validator=int_at_least(1))

    def __attrs_post_init__(self) -> None:
        if self.spread < 0 or (self.kind == "uniform" and self.spread > 1):
            raise ConfigError(f"spread must be in [0, 1] for uniform, >= 0 otherwise, got {self.spread}")
        if self.min_len > self.max_len:
            raise ConfigError(f"min_len must be <= max_len ({self.max_len}), got {self.min_len}")

    def sample(self, rng: random.Random) -> int:
        """One length drawn from ``rng`` (advances it). O(1)."""
        kind, m = self.kind, self.mean
        if kind == "fixed":
            x = m
        elif kind == "uniform":
            x = rng.uniform(m * (1 - self.spread), m * (1 + self.spread))
        elif kind == "exponential":
            x = rng.expovariate(1.0 / m)
        else:
            s = self.spread
            x = rng.lognormvariate(math.log(m) - s * s / 2, s)
        return min(max(int(round(x)), self.min_len), self.max_len)

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """``"KIND:MEAN[:SPREAD[:MIN[:MAX]]]"`` (e.g. ``"lognormal:500:0.6:16:4000"``) or a
        bare number (fixed).

        Raises:
            ConfigError: malformed text or invalid values (names the text).
        """
        parts = text.split(":")
        try:
            if len(parts) == 1:
                return cls("fixed", float(parts[0]))
            nums = [float(p) for p in parts[1:]]
            spread = nums[1] if len(nums) > 1 else 0.5
            low = int(nums[2]) if len(nums) > 2 else 1
            high = int(nums[3]) if len(nums) > 3 else 1 << 20
            return cls(parts[0], nums[0], spread, low, high)
        except (ValueError, IndexError) as exc:
            raise ConfigError(
                f"a length distribution must read KIND:MEAN[:SPREAD[:MIN[:MAX]]], got {text!r}"
            ) from exc
