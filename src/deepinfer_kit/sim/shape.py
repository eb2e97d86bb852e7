"""shape_of: the StepShape of a round, from its chunks (the plan's or a trace's)."""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer_kit.sched.records import SchedulePlan
from deepinfer_kit.sim.records import StepShape

__all__ = ["shape_of", "plan_shape"]


def shape_of(rows: Sequence[tuple[bool, int, int, bool]]) -> StepShape:
    """The :class:`StepShape` of chunks given as ``(is_prefill, start, num_tokens,
    sampled)`` rows (one per chunk). Pure; O(chunks)."""
    prefill = decode = context = sampled = pairs = 0
    for is_prefill, start, n, sample in rows:
        if is_prefill:
            prefill += n
        else:
            decode += 1
        context += start + n
        pairs += n * start + n * (n + 1) // 2
        if sample:
            sampled += 1
    return StepShape(prefill, decode, context, sampled, pairs, len(rows))


def _window_pairs(start: int, end: int, window: int) -> int:
    """``sum min(p + 1, window)`` over positions ``start .. end - 1``: the keys each
    query of a sliding-window layer reads."""
    a, b = start + 1, end
    if b <= window:
        return (a + b) * (b - a + 1) // 2
    if a > window:
        return window * (b - a + 1)
    return (a + window) * (window - a + 1) // 2 + window * (b - window)


def plan_shape(plan: SchedulePlan, window: int | None = None) -> StepShape:
    """The :class:`StepShape` of ``plan`` (see :func:`shape_of`); with a ``window``, also
    what a sliding-window layer reads (``num_window_context_tokens``,
    ``window_attention_pairs``). Pure; O(chunks)."""
    shape = _plan_shape(plan)
    if window is None:
        return shape
    ctx = pairs = 0
    for s in plan.decodes.starts:
        w = s + 1 if s < window else window
        ctx += w
        pairs += w
    for chunk in plan.chunks:
        start, end = chunk.start, chunk.start + chunk.num_tokens
        ctx += min(end, window + chunk.num_tokens - 1)
        pairs += _window_pairs(start, end, window)
    shape.num_window_context_tokens = ctx
    shape.window_attention_pairs = pairs
    return shape


def _plan_shape(plan: SchedulePlan) -> StepShape:
    rows = plan.decodes
    decode = sampled = len(rows.request_ids)
    context = pairs = sum(rows.starts) + decode  # a row feeds one token at its start
    prefill = spec = 0
    for chunk in plan.chunks:
        n = chunk.num_tokens
        start = chunk.start
        if n == 1:  # the common row, without the general arithmetic
            if chunk.sample:
                decode += 1
                sampled += 1
            else:
                prefill += 1
            context += start + 1
            pairs += start + 1
            continue
        if chunk.is_prefill:
            prefill += n
        else:
            decode += 1
            spec += n - 1  # drafts verified after the known token
        context += start + n
        pairs += n * start + n * (n + 1) // 2
        if chunk.sample:
            sampled += 1
    return StepShape(prefill, decode, context, sampled, pairs, plan.num_chunks, spec)
