"""Two-sample statistics of token draws: total-variation distance and a chi-square
homogeneity test (the distribution checks of speculative decoding read them)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import attrs

__all__ = ["SampleComparison", "tv_distance", "chi_square_homogeneity", "compare_samples"]


def tv_distance(a: Sequence[int], b: Sequence[int]) -> float:
    """Total-variation distance ``½ Σ_x |P_a(x) − P_b(x)|`` between the empirical
    distributions of two non-empty samples of token ids. Pure; O(len(a) + len(b))."""
    if not a or not b:
        raise ValueError(f"tv_distance needs two non-empty samples, got {len(a)} and {len(b)}")
    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    return 0.5 * sum(abs(ca[x] / na - cb[x] / nb) for x in ca.keys() | cb.keys())


def chi_square_homogeneity(a: Sequence[int], b: Sequence[int], *,
                           min_expected: float = 5.0) -> tuple[float, int, float]:
    """Pearson's chi-square test that two samples come from one distribution.

    Values whose expected count is below ``min_expected`` in either sample are pooled into
    one cell (the test's usual validity rule); the 2 x K contingency table then has
    ``K − 1`` degrees of freedom. Pure; O(len(a) + len(b) + K log K).

    Returns:
        ``(statistic, degrees of freedom, p-value)``; a p-value of 1.0 when fewer than two
        cells remain (nothing to tell apart).
    """
    import torch

    if not a or not b:
        raise ValueError(f"chi_square_homogeneity needs two non-empty samples, got {len(a)} and {len(b)}")
    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    total = na + nb
    cells: list[tuple[int, int]] = []
    pooled = [0, 0]
    for x in sorted(ca.keys() | cb.keys()):
        n = ca[x] + cb[x]
        if min(na, nb) * n / total < min_expected:
            pooled[0] += ca[x]
            pooled[1] += cb[x]
        else:
            cells.append((ca[x], cb[x]))
    if sum(pooled):
        cells.append((pooled[0], pooled[1]))
    if len(cells) < 2:
        return 0.0, 0, 1.0
    stat = 0.0
    for oa, ob in cells:
        n = oa + ob
        ea, eb = na * n / total, nb * n / total
        stat += (oa - ea) ** 2 / ea + (ob - eb) ** 2 / eb
    df = len(cells) - 1
    p = float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                      torch.tensor(stat / 2.0, dtype=torch.float64)))
    return stat, df, p


@attrs.frozen(slots=True)
class SampleComparison:
    """Two samples of one output position compared.

    Attributes:
        position: the output position (0 for the first generated token).
        tv: total-variation distance between the two samples.
        statistic, dof, p_value: the chi-square homogeneity test.
    """

    position: int
    tv: float
    statistic: float
    dof: int
    p_value: float


def compare_samples(position: int, a: Sequence[int], b: Sequence[int]) -> SampleComparison:
    """:func:`tv_distance` and :func:`chi_square_homogeneity` of ``a`` and ``b``."""
    stat, dof, p = chi_square_homogeneity(a, b)
    return SampleComparison(position, tv_distance(a, b), stat, dof, p)
