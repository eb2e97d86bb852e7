"""Contract of the sample package: the Sampler."""

from __future__ import annotations

from typing import Protocol

import torch

from deepinfer_kit.sample.records import SampleResult, SamplingBatch

__all__ = ["Sampler", "DrawOps"]


class Sampler(Protocol):
    """Turns one row of logits per sequence into the next token.

    Seeded rows are batch-invariant: given identical logits, a row with seed ``s`` at
    output position ``j`` draws the same token whatever other rows share the batch.
    """

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
        """Apply penalties, ``min_tokens`` masking, temperature, top-k / top-p / min-p and
        draw one token per row.

        Called once per engine step on the rows that sample. Per row, in this order:
        repetition penalty over prompt and output tokens, frequency / presence penalties
        over output tokens, ``-inf`` on EOS (unless ``ignore_eos``) and stop tokens while
        fewer than ``min_tokens`` tokens exist, temperature, top-k, top-p, min-p, the draw
        (``reference.filtered_distribution`` is the float64 spec). Top-k / top-p rank
        tokens by logit, ties by ascending id, so a tie at the cut keeps exactly ``k``.
        Greedy rows (temperature 0 or top_k 1) return the argmax, lowest id on ties; a row
        with no finite logit returns token 0. Logprobs come from the raw logits. Unseeded
        rows consume ``batch.generator``; seeded rows never do.

        Args:
            logits: ``[N, V]`` float (fp32, fp16 or bf16) on any device; not mutated.
            batch: ``N`` rows of parameters and history.

        Returns:
            A :class:`SampleResult` on the device of ``logits``.

        Raises:
            InvariantError: ``logits.shape[0] != len(batch)``.
        """
        ...


class DrawOps(Protocol):
    """The hot-path tensor ops of :class:`~deepinfer_kit.sample.VectorizedSampler`.

    Two implementations with identical semantics: ``sample.ref_ops`` (torch, the spec) and
    ``sample.triton_ops`` (Triton kernels); a sampler picks one at construction. See
    ``ref_ops`` for the exact arithmetic each op must reproduce.
    """

    def row_norm(self, x: torch.Tensor, rows: torch.Tensor, inv_t: torch.Tensor) -> torch.Tensor:
        """``[n]`` float64 softmax denominators of rows ``rows`` of ``x [N, V]`` at
        temperature ``1 / inv_t`` (max-subtracted, so ``>= 1`` for a finite row)."""
        ...

    def full_draw(
        self,
        x: torch.Tensor,
        rows: torch.Tensor,
        inv_t: torch.Tensor,
        min_p: torch.Tensor,
        u: torch.Tensor,
    ) -> torch.Tensor:
        """``[n]`` int64 tokens drawn by inverse CDF over the whole vocabulary (min-p only)."""
        ...

    def candidate_draw(
        self,
        vals: torch.Tensor,
        idx: torch.Tensor,
        inv_t: torch.Tensor,
        k: torch.Tensor,
        p: torch.Tensor,
        min_p: torch.Tensor,
        z: torch.Tensor,
        u: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k / top-p / min-p over sorted candidates ``[n, W]``, then the draw:
        ``(tokens [n] int64, kept [n] int64)``, ``kept == -1`` when ``W`` was too few."""
        ...

    def nucleus_draw(
        self,
        x: torch.Tensor,
        rows: torch.Tensor,
        inv_t: torch.Tensor,
        p: torch.Tensor,
        min_p: torch.Tensor,
        u: torch.Tensor,
    ) -> torch.Tensor:
        """``[n]`` int64 tokens of top-p rows without top-k, drawn over the whole row in a
        fixed number of passes, whatever the nucleus width: the same token
        :meth:`candidate_draw` gives over the row's full sorted order with ``z`` the rows'
        :meth:`row_norm` (which this op sums itself)."""
        ...
