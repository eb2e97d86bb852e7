"""ProfiledCost: a round's time as a linear function of its shape, fit by least squares
from measured rounds (verified draft tokens included)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sim.records import StepShape

__all__ = ["ProfiledCost", "fit_profiled_cost", "features", "FEATURE_NAMES"]

#: The terms of the fit, in coefficient order.
FEATURE_NAMES = ("constant", "prefill_tokens", "decode_rows", "context_tokens", "spec_tokens")
_SPEC = FEATURE_NAMES.index("spec_tokens")


def features(shape: StepShape) -> tuple[float, float, float, float, float]:
    """The regressors of ``shape``, in :data:`FEATURE_NAMES` order. Pure."""
    return (1.0, float(shape.num_prefill_tokens), float(shape.num_decode_rows),
            float(shape.num_context_tokens), float(shape.num_spec_tokens))


@attrs.frozen(slots=True)
class ProfiledCost:
    """``t = constant + a * prefill_tokens + b * decode_rows + c * context_tokens
    + d * spec_tokens``.

    ``spec_tokens`` are the draft tokens a round verifies (``StepShape.num_spec_tokens``,
    fed after a decode row's known token, each a token of work with its own LM-head
    row). Their coefficient is fit when the measured rounds verified drafts; otherwise
    (``per_spec_token`` ``None``) a verified draft is priced as a decode row: it is
    computed and its logits are read like one.

    Attributes:
        constant: seconds per round.
        per_prefill_token, per_decode_row, per_context_token: seconds per unit.
        source: where the coefficients came from (for reports).
        per_spec_token: seconds per verified draft token, or ``None`` (priced as
            ``per_decode_row``).
    """

    constant: float
    per_prefill_token: float
    per_decode_row: float
    per_context_token: float
    source: str = ""
    per_spec_token: float | None = None

    def step_time(self, shape: StepShape) -> float:
        """See :meth:`CostModel.step_time`. Pure; O(1)."""
        t = (
            self.constant
            + self.per_prefill_token * shape.num_prefill_tokens
            + self.per_decode_row * shape.num_decode_rows
            + self.per_context_token * shape.num_context_tokens
        )
        if shape.num_spec_tokens:
            per_spec = self.per_spec_token
            t += (self.per_decode_row if per_spec is None else per_spec) * shape.num_spec_tokens
        return t

    def decode_round_times(self, num_seqs: int, context: int, start: float, until: float,
                           max_rounds: int) -> list[float]:
        """See :meth:`DecodeRoundCost.decode_round_times`: :meth:`step_time`'s arithmetic,
        in its order, for one plain-decode round after another. Pure; O(rounds)."""
        head = self.constant + self.per_prefill_token * 0 + self.per_decode_row * num_seqs
        per_context = self.per_context_token
        times: list[float] = []
        now = start
        while len(times) < max_rounds and (not times or now < until):
            d = head + per_context * context
            times.append(d)
            now += d
            context += num_seqs
        return times

    def to_dict(self) -> dict[str, float | str | None]:
        """The coefficients as a JSON-ready dict (``from_dict`` reads it back)."""
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ProfiledCost:
        """Coefficients written by :meth:`to_dict` (``per_spec_token`` may be absent or
        ``None``: files written before it existed load unchanged).

        Raises:
            ConfigError: a missing or non-numeric coefficient.
        """
        try:
            per_spec = data.get("per_spec_token")
            return cls(
                float(data["constant"]),  # type: ignore[arg-type]
                float(data["per_prefill_token"]),  # type: ignore[arg-type]
                float(data["per_decode_row"]),  # type: ignore[arg-type]
                float(data["per_context_token"]),  # type: ignore[arg-type]
                str(data.get("source", "")),
                None if per_spec is None else float(per_spec),  # type: ignore[arg-type]
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"profiled cost coefficients are malformed: {exc!r}") from exc


def _solve(rows: Sequence[Sequence[float]], ys: Sequence[float], ws: Sequence[float],
           active: Sequence[int]) -> list[float]:
    """Weighted least squares over the ``active`` columns (normal equations, Gaussian
    elimination with partial pivoting; the system is at most 4 x 4)."""
    k = len(active)
    a = [[0.0] * (k + 1) for _ in range(k)]
    for row, y, w in zip(rows, ys, ws):
        x = [row[j] for j in active]
        for i in range(k):
            wx = w * x[i]
            for j in range(k):
                a[i][j] += wx * x[j]
            a[i][k] += wx * y
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        if abs(a[col][col]) < 1e-300:
            raise ConfigError(f"cannot fit {FEATURE_NAMES[active[col]]}: it never varies")
        for r in range(k):
            if r != col:
                f = a[r][col] / a[col][col]
                for c in range(col, k + 1):
                    a[r][c] -= f * a[col][c]
    return [a[i][k] / a[i][i] for i in range(k)]


def fit_profiled_cost(shapes: Sequence[StepShape], seconds: Sequence[float], *,
                      source: str = "", trim: float = 3.0) -> ProfiledCost:
    """Fit :class:`ProfiledCost` to measured rounds.

    Least squares on relative error (each round weighted by ``1 / t^2``, so fast decode
    rounds count as much as long prefills), coefficients kept non-negative (a negative
    one is dropped and the rest refit), then rounds whose residual exceeds ``trim``
    times the median absolute relative residual (a descheduled thread, a GC pause) are
    dropped and the fit repeated once. The ``spec_tokens`` term is fit only when some
    round verified drafts (else ``per_spec_token`` is ``None``). Pure.

    Raises:
        ConfigError: fewer than 8 rounds, a non-positive time, or a singular system.
    """
    if len(shapes) != len(seconds) or len(shapes) < 8:
        raise ConfigError(f"need >= 8 measured rounds with one time each, got {len(shapes)}")
    if min(seconds) <= 0:
        raise ConfigError(f"measured times must be > 0, got {min(seconds)}")
    rows = [features(s) for s in shapes]
    ys = list(seconds)
    with_spec = any(r[_SPEC] for r in rows)
    coef = _nonnegative_fit(rows, ys, with_spec)
    rel = [abs(_dot(coef, r) - y) / y for r, y in zip(rows, ys)]
    cut = trim * sorted(rel)[len(rel) // 2]
    keep = [i for i, e in enumerate(rel) if e <= cut]
    if cut > 0 and 8 <= len(keep) < len(rows):
        kept = [rows[i] for i in keep]
        with_spec = any(r[_SPEC] for r in kept)
        coef = _nonnegative_fit(kept, [ys[i] for i in keep], with_spec)
    return ProfiledCost(coef[0], coef[1], coef[2], coef[3], source,
                        coef[_SPEC] if with_spec else None)


def _nonnegative_fit(rows: Sequence[Sequence[float]], ys: Sequence[float],
                     with_spec: bool) -> list[float]:
    """Coefficients in :data:`FEATURE_NAMES` order, each >= 0; the ``spec_tokens`` one is
    0 unless ``with_spec`` (a column of zeros cannot be solved for)."""
    weights = [1.0 / (y * y) for y in ys]
    active = [j for j in range(len(FEATURE_NAMES)) if with_spec or j != _SPEC]
    while True:
        sol = _solve(rows, ys, weights, active)
        worst = min(range(len(active)), key=lambda i: sol[i])
        if sol[worst] >= 0 or len(active) == 1:
            coef = [0.0] * len(FEATURE_NAMES)
            for j, v in zip(active, sol):
                coef[j] = max(v, 0.0)
            return coef
        del active[worst]


def _dot(coef: Sequence[float], row: Sequence[float]) -> float:
    return sum(c * x for c, x in zip(coef, row))


if TYPE_CHECKING:
    from deepinfer_kit.sim.protocols import CostModel, DecodeRoundCost

    _check: type[CostModel] = ProfiledCost
    _rounds: type[DecodeRoundCost] = ProfiledCost
