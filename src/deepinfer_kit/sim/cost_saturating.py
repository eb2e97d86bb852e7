"""SaturatingCost: a round's price as a function of its tokens alone — flat while the
weights' read dominates (memory-bound), then linear in tokens (compute-bound) — and
``profile_sps``, the steps-per-second curve an engine profiles at start, read from any
cost model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sim.cost_analytic import GpuSpec, ModelShape
from deepinfer_kit.sim.protocols import CostModel
from deepinfer_kit.sim.records import StepShape
from deepinfer_kit.spec.records import SpsCurve

__all__ = ["SaturatingCost", "profile_sps"]


class SaturatingCost:
    """``step_time = max(memory_s, token_s · tokens + row_s · rows) + overhead_s``.

    ``tokens`` counts every token fed (prefill, decode and verified drafts); ``rows`` the
    LM-head rows (sampled chunks and verified drafts). ``SPS(B)`` is then flat up to the
    knee ``B ≈ memory_s / (token_s + row_s)`` and falls as ``1 / B`` past it. This is
    :class:`AnalyticCost` without the KV traffic: the step time depends on the round's
    tokens only, so one profiled ``SPS(B)`` describes every round exactly (with KV reads
    it would depend on each request's context too, which a one-dimensional curve cannot
    hold).

    Args:
        memory_s: seconds to read the weights once.
        token_s: seconds of compute per token fed.
        row_s: seconds of compute per LM-head row.
        overhead_s: fixed seconds per round (host work, launches).

    Raises:
        ConfigError: a negative or non-finite field, or ``memory_s`` and ``token_s``
            both 0.
    """

    __slots__ = ("memory_s", "token_s", "row_s", "overhead_s")

    def __init__(self, memory_s: float, token_s: float, row_s: float = 0.0,
                 overhead_s: float = 0.0) -> None:
        for name, v in (("memory_s", memory_s), ("token_s", token_s), ("row_s", row_s),
                        ("overhead_s", overhead_s)):
            if not 0 <= v < float("inf"):
                raise ConfigError(f"{name} must be a finite number >= 0, got {v!r}")
        if memory_s + token_s + overhead_s == 0:
            raise ConfigError("memory_s, token_s and overhead_s are all 0: every round would be free")
        self.memory_s = memory_s
        self.token_s = token_s
        self.row_s = row_s
        self.overhead_s = overhead_s

    @classmethod
    def from_shape(cls, model: ModelShape, gpu: GpuSpec) -> SaturatingCost:
        """The roofline of ``model`` on ``gpu``: the weights' bytes over the bandwidth,
        ``2 · layer_params`` FLOPs per token, ``2 · H · V`` per LM-head row, the GPU's
        per-round overhead."""
        bw = gpu.memory_bandwidth * gpu.bandwidth_efficiency
        peak = gpu.peak_flops * gpu.flops_efficiency
        return cls(
            memory_s=model.num_params * model.dtype_bytes / bw,
            token_s=2.0 * model.layer_params / peak,
            row_s=2.0 * model.hidden_size * model.vocab_size / peak,
            overhead_s=gpu.step_overhead_s,
        )

    @property
    def knee_tokens(self) -> float:
        """The ``B`` (tokens, each an LM-head row) where compute overtakes the weights' read."""
        per = self.token_s + self.row_s
        return self.memory_s / per if per > 0 else float("inf")

    def step_time(self, shape: StepShape) -> float:
        """See :meth:`CostModel.step_time`. Pure; O(1)."""
        compute = self.token_s * shape.num_tokens + self.row_s * (
            shape.num_sampled_rows + shape.num_spec_tokens)
        return (self.memory_s if self.memory_s > compute else compute) + self.overhead_s


def profile_sps(cost: CostModel, max_tokens: int, *, stride: int = 1,
                context_per_token: int = 0) -> SpsCurve:
    """``SPS(B)`` of ``cost`` at ``B = 1, 1 + stride, …`` up to ``max_tokens`` (always
    included): each point prices a decode round of ``B`` one-token chunks (every token an
    LM-head row, ``context_per_token`` KV positions read per chunk), as an engine times
    dummy decode batches at start. Called once per planner build; pure.

    ``stride`` 1 is exact at every integer ``B`` for any cost; a coarser grid interpolates
    ``SPS`` linearly, which overstates it past the knee (``1 / B`` is convex) and
    understates it in the interval holding the knee.

    Raises:
        ConfigError: ``max_tokens`` or ``stride`` < 1, or a non-positive step time.
    """
    if max_tokens < 1 or stride < 1:
        raise ConfigError(f"max_tokens and stride must be >= 1, got {max_tokens} and {stride}")
    points = list(range(1, max_tokens + 1, stride))
    if points[-1] != max_tokens:
        points.append(max_tokens)
    sps: list[float] = []
    for b in points:
        ctx = b * context_per_token
        t = cost.step_time(StepShape(0, b, ctx + b, b, b * ctx + b, b))
        if not t > 0:
            raise ConfigError(f"the cost model priced a round of {b} tokens at {t!r} s; SPS needs > 0")
        sps.append(1.0 / t)
    return SpsCurve(points, sps)


if TYPE_CHECKING:
    _check: type[CostModel] = SaturatingCost
