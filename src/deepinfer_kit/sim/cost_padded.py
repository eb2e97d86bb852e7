"""PaddedCost: the price of rounds replayed as captured CUDA graphs — a round is padded to
the smallest captured size that holds its tokens, so its time is a staircase in the
round's size; :func:`ladder_sps` reads that staircase as an ``SpsCurve``."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sim.protocols import CostModel
from deepinfer_kit.sim.records import StepShape
from deepinfer_kit.spec.records import SpsCurve

__all__ = ["PaddedCost", "ladder_sps"]


class PaddedCost:
    """``inner``'s price of a round padded to a ladder of captured sizes.

    A round of ``B`` tokens (prefill, decode rows and verified drafts) up to the ladder's
    top runs the graph of the smallest size ``>= B`` (mixed rounds included, as piecewise
    graphs pad them: vLLM's capture sizes bound a round's tokens, not its requests): it is
    priced as ``inner`` prices it with ``size - B`` more decode rows (each a token of work
    and an LM-head row, reading one KV position, as a padded row does). Larger rounds run
    eagerly: priced as they are.

    Args:
        inner: the cost of an unpadded round.
        sizes: increasing captured sizes (tokens per round), each >= 1.

    Raises:
        ConfigError: ``sizes`` empty, not increasing, or below 1.
    """

    __slots__ = ("inner", "sizes")

    def __init__(self, inner: CostModel, sizes: Sequence[int]) -> None:
        sizes = [int(s) for s in sizes]
        if not sizes or sizes[0] < 1 or any(b <= a for a, b in zip(sizes, sizes[1:])):
            raise ConfigError(f"PaddedCost sizes must be increasing counts >= 1, got {sizes}")
        self.inner = inner
        self.sizes = sizes

    def padded(self, shape: StepShape) -> StepShape:
        """``shape`` as the graph that would run it sees it (unchanged when it runs eagerly). Pure."""
        tokens = shape.num_tokens
        if tokens > self.sizes[-1] or tokens == 0:
            return shape
        pad = self.sizes[bisect.bisect_left(self.sizes, tokens)] - tokens
        if not pad:
            return shape
        return attrs.evolve(shape, num_decode_rows=shape.num_decode_rows + pad,
                            num_context_tokens=shape.num_context_tokens + pad,
                            num_sampled_rows=shape.num_sampled_rows + pad,
                            attention_pairs=shape.attention_pairs + pad, num_chunks=shape.num_chunks + pad)

    def step_time(self, shape: StepShape) -> float:
        """See :meth:`CostModel.step_time`: ``inner``'s price of :meth:`padded`. O(log sizes)."""
        return self.inner.step_time(self.padded(shape))


def ladder_sps(cost: PaddedCost) -> SpsCurve:
    """The staircase ``SpsCurve`` of ``cost``'s captured sizes: each size priced as a round
    of that many one-token decode rows (what an engine times when it profiles its graphs).

    Raises:
        ConfigError: a size priced at a non-positive time.
    """
    times = [cost.step_time(StepShape(0, b, b, b, b, b)) for b in cost.sizes]
    if any(not t > 0 for t in times):
        raise ConfigError(f"the cost priced a captured size at {min(times)!r} s; SPS needs > 0")
    return SpsCurve.ladder(cost.sizes, times)


if TYPE_CHECKING:
    _check: type[CostModel] = PaddedCost
