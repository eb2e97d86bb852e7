"""AcceptanceModel: the seeded stand-in for a drafter's quality — per request and draft
position, the true probability that a draft is right and the confidence the drafter
reports for it. Host-only; pure functions of (seed, request id, output position, depth).

For request ``r``, a round whose first sample draws output position ``q``, and draft depth
``j`` (the draft for output position ``t = q + j``):

* ``d_r ~ Beta(difficulty_alpha, difficulty_beta)``, drawn once per request: how
  predictable the request is;
* ``c = clip(d_r · (1 − token_spread · w_t) · decay^j)``, ``w_t ~ U(0, 1)`` per output
  position (some tokens are hard whatever the round): the **calibrated confidence**;
* the true acceptance probability ``p = c + noise · min(c, 1 − c) · (2u − 1)``,
  ``u ~ U(0, 1)`` per ``(r, q, j)``: symmetric around ``c``, so ``E[p | c] = c`` — the
  confidence is right in expectation, not per draft;
* the draft is right when ``v < p``, ``v ~ U(0, 1)`` per ``(r, q, j)``, independently
  of the other depths; verification accepts the drafts up to the first wrong one, so the
  accepted length ``L`` has ``P(L >= k) = prod_{j<k} p_j``.

The drafter reports ``c ** confidence_power``: 1 is calibrated; below 1 overconfident,
above 1 underconfident (the miscalibrated variants the study contrasts).
"""

from __future__ import annotations

import random

import attrs

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sim.tokens import request_base

__all__ = ["AcceptanceModel"]

_M64 = (1 << 64) - 1
_INV = 1.0 / (1 << 53)
_EPS = 1e-3


def _mix(x: int) -> int:
    """splitmix64's finaliser: a 64-bit integer hash (pure, the same in every process)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _uniform(base: int, a: int, b: int, salt: int) -> float:
    """A uniform in [0, 1) keyed by ``(base, a, b, salt)``."""
    return (_mix(base ^ _mix((a << 24) ^ (b << 4) ^ salt)) >> 11) * _INV


def _positive(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0 < float(value) < float("inf"):
        raise ConfigError(f"acceptance.{attribute.name} must be a finite number > 0, got {value!r}")


def _unit(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0 <= float(value) <= 1:
        raise ConfigError(f"acceptance.{attribute.name} must be in [0, 1], got {value!r}")


@attrs.frozen(slots=True)
class AcceptanceModel:
    """Synthetic draft quality, seeded (see the module docstring for the model).

    Attributes:
        seed: varies every draw.
        difficulty_alpha, difficulty_beta: the Beta distribution of the per-request
            predictability ``d_r`` (defaults: mean 0.85).
        token_spread: how much a hard output position lowers the confidence, in [0, 1].
        decay: factor per draft depth, in (0, 1].
        noise: spread of the true probability around the confidence, in [0, 1].
        confidence_power: the drafter reports ``c ** confidence_power`` (1: calibrated).

    Raises:
        ConfigError: a field out of range (named, with its value).
    """

    seed: int = 0
    difficulty_alpha: float = attrs.field(default=6.0, validator=_positive)
    difficulty_beta: float = attrs.field(default=1.0, validator=_positive)
    token_spread: float = attrs.field(default=0.5, validator=_unit)
    decay: float = attrs.field(default=0.95, validator=_unit)
    noise: float = attrs.field(default=0.5, validator=_unit)
    confidence_power: float = attrs.field(default=1.0, validator=_positive)
    _difficulty: dict[str, tuple[int, float]] = attrs.field(
        factory=dict, init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        if self.decay == 0:
            raise ConfigError("acceptance.decay must be in (0, 1], got 0")

    def _request(self, request_id: str) -> tuple[int, float]:
        """``(hash base, d_r)`` of a request, cached (a request's Beta draw is made once)."""
        got = self._difficulty.get(request_id)
        if got is None:
            base = request_base(self.seed, request_id)
            d = random.Random(base).betavariate(self.difficulty_alpha, self.difficulty_beta)
            got = self._difficulty[request_id] = (base, d)
        return got

    def forget(self, request_id: str) -> None:
        """Drop a finished request's cached difficulty (its draws stay reproducible)."""
        self._difficulty.pop(request_id, None)

    def difficulty(self, request_id: str) -> float:
        """``d_r``, the request's predictability in (0, 1). Pure but for the cache."""
        return self._request(request_id)[1]

    def confidence(self, request_id: str, position: int, depth: int) -> float:
        """The calibrated confidence ``c`` of the draft at depth ``depth`` of a round whose
        first sample is output ``position`` (the draft for ``position + depth``)."""
        base, d = self._request(request_id)
        w = _uniform(base, position + depth, 0, 1)
        c = d * (1.0 - self.token_spread * w) * self.decay ** depth
        return min(1.0 - _EPS, max(_EPS, c))

    def reported(self, request_id: str, position: int, depth: int) -> float:
        """What the drafter reports: ``confidence ** confidence_power``."""
        c = self.confidence(request_id, position, depth)
        return c if self.confidence_power == 1.0 else c ** self.confidence_power

    def true_probability(self, request_id: str, position: int, depth: int) -> float:
        """``p``: the probability this draft is right; ``E[p | c] = c``."""
        base, _ = self._request(request_id)
        c = self.confidence(request_id, position, depth)
        u = _uniform(base, position, depth, 2)
        return c + self.noise * min(c, 1.0 - c) * (2.0 * u - 1.0)

    def draft_is_right(self, request_id: str, position: int, depth: int) -> bool:
        """Whether the draft at ``depth`` of the round at ``position`` equals the target's
        token: a Bernoulli(``p``) draw keyed by ``(seed, request, position, depth)``."""
        base, _ = self._request(request_id)
        p = self.true_probability(request_id, position, depth)
        return _uniform(base, position, depth, 3) < p

    def accepted_length(self, request_id: str, position: int, length: int) -> int:
        """Drafts accepted when ``length`` are verified in the round at ``position``: the
        number before the first wrong one (greedy verification). O(accepted + 1)."""
        n = 0
        while n < length and self.draft_is_right(request_id, position, n):
            n += 1
        return n
