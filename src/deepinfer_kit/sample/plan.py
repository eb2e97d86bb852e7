"""Row planning of the vectorized sampler: which rows are greedy, which draw from the whole
vocabulary, and which need a candidate set (and of what kind), from host-side parameters.

Pure Python over the ``N`` rows' parameters; no tensor work.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import attrs

from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sample.records import SamplingBatch

__all__ = ["RowPlan", "PlanMemo", "plan_rows", "same_objects", "MIN_TOPK_WIDTH", "MAX_TOPK_WIDTH", "MAX_INV_TEMPERATURE"]

MIN_TOPK_WIDTH = 64
"""Narrowest ``torch.topk`` candidate set (small k share one call)."""
MAX_TOPK_WIDTH = 4096
"""Widest ``torch.topk`` candidate set; larger k go to the histogram threshold."""
MAX_INV_TEMPERATURE = 1e30
"""``1 / temperature`` is capped here so float32 never overflows (``0 * inf`` is NaN)."""


@attrs.define(slots=True)
class RowPlan:
    """Rows of one batch grouped by what they need (indices into the batch).

    Attributes:
        greedy: rows whose token is the argmax (temperature 0 or top_k 1).
        full: sampled rows without top-k / top-p: inverse CDF over the vocabulary.
        nucleus: top-p rows without top-k: ``nucleus_draw`` over the whole row.
        topk: ``width -> rows`` drawn from a ``torch.topk`` candidate set of that width.
        threshold: rows drawn from a histogram-threshold candidate set (large k).
        sort: rows drawn from a full sort (only when a candidate width would reach ``V``).
        inv_t: ``[N]`` ``1 / temperature`` (1 for greedy rows).
        top_k: ``[N]`` effective k (``V`` when off).
        top_p: ``[N]`` top-p (1 when off).
        min_p: ``[N]`` min-p (0 when off).
    """

    greedy: list[int] = attrs.Factory(list)
    full: list[int] = attrs.Factory(list)
    nucleus: list[int] = attrs.Factory(list)
    topk: dict[int, list[int]] = attrs.Factory(dict)
    threshold: list[int] = attrs.Factory(list)
    sort: list[int] = attrs.Factory(list)
    inv_t: list[float] = attrs.Factory(list)
    top_k: list[int] = attrs.Factory(list)
    top_p: list[float] = attrs.Factory(list)
    min_p: list[float] = attrs.Factory(list)

    @property
    def sampled(self) -> list[int]:
        """Every non-greedy row, ascending."""
        greedy = set(self.greedy)
        return [i for i in range(len(self.inv_t)) if i not in greedy]


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def plan_rows(batch: SamplingBatch, vocab: int) -> RowPlan:
    """Group the rows of ``batch`` for logits of vocabulary ``vocab``.

    A top-p row without top-k goes to ``nucleus_draw`` (its cost does not depend on the
    nucleus, so no candidate set is tried first). A top-k row gets a ``torch.topk`` width
    of ``max(64, next_pow2(k + 1))`` (one more than k, so a tie at the k-th value is
    detectable); a width ``>= V`` means a full sort (cheap then: V is small), and a width
    above :data:`MAX_TOPK_WIDTH` means the histogram threshold.
    """
    every = batch.params
    if all([p.is_greedy for p in every]):  # a list first: all() over a generator costs more
        return _all_greedy(every, vocab)
    plan = RowPlan()
    for i, params in enumerate(every):
        topk_on = 1 <= params.top_k < vocab
        topp_on = params.top_p < 1.0
        plan.inv_t.append(1.0 if params.is_greedy else min(1.0 / params.temperature, MAX_INV_TEMPERATURE))
        plan.top_k.append(params.top_k if topk_on else vocab)
        plan.top_p.append(params.top_p)
        plan.min_p.append(params.min_p)
        if params.is_greedy:
            plan.greedy.append(i)
            continue
        if not (topk_on or topp_on):
            plan.full.append(i)
            continue
        if not topk_on:
            plan.nucleus.append(i)
            continue
        width = max(MIN_TOPK_WIDTH, _next_pow2(params.top_k + 1))
        if width >= vocab:
            plan.sort.append(i)
        elif width > MAX_TOPK_WIDTH:
            plan.threshold.append(i)
        else:
            plan.topk.setdefault(width, []).append(i)
    return plan


def _all_greedy(every: Sequence[SamplingParams], vocab: int) -> RowPlan:
    """:func:`plan_rows` of a batch whose every row is greedy, column by column."""
    return RowPlan(
        greedy=list(range(len(every))),
        inv_t=[1.0] * len(every),
        top_k=[p.top_k if 1 <= p.top_k < vocab else vocab for p in every],
        top_p=[p.top_p for p in every],
        min_p=[p.min_p for p in every],
    )


def same_objects(a: Sequence[object], b: Sequence[object]) -> bool:
    """True when ``a`` and ``b`` hold the very same objects in the same order (identity,
    not equality: no ``__eq__`` runs). O(len), in C."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


class PlanMemo:
    """The :func:`plan_rows` of the last batch planned, reused for the next batch whose
    ``params`` are the very same objects in the same order (a decode round after a decode
    round of the same sequences): an identity check per row instead of planning each.
    Also remembers whether a row of those params may edit its logits before the draw
    (penalties, or a ``min_tokens``). The plan is shared between the calls: read only.

    One memo per sampler; the sampler's calls do not overlap (one executing thread).
    """

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: tuple[list[SamplingParams], int, RowPlan, bool] | None = None

    def plan(self, batch: SamplingBatch, vocab: int) -> tuple[RowPlan, bool]:
        """``(plan_rows(batch, vocab), may_edit)``: ``may_edit`` False when no row has
        penalties or a ``min_tokens`` (so no row's logits need editing)."""
        params = batch.params
        last = self._last
        if last is not None and last[1] == vocab and same_objects(last[0], params):
            return last[2], last[3]
        plan = plan_rows(batch, vocab)
        may_edit = any([p.has_penalties or p.min_tokens > 0 for p in params])
        self._last = (list(params), vocab, plan, may_edit)
        return plan, may_edit
