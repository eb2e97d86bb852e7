"""Records of the sample package: the per-row parameters of a batch, and what was drawn."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from deepinfer_kit.sample.params import SamplingParams

__all__ = ["SamplingBatch", "SampleResult"]


@attrs.define(slots=True, eq=False)
class SamplingBatch:
    """Per-row sampling state for ``N`` rows of logits (host-side Python values).

    A request may own several rows (speculative verification, forks); each row names the
    output position it draws, which keys its random stream.

    Attributes:
        params: ``[N]`` the row's parameters.
        seeds: ``[N]`` the sequence's seed, or ``None`` to draw from ``generator``.
        positions: ``[N]`` index of the output token being drawn (0 for the first).
        prompt_token_ids: ``[N]`` prompt tokens (repetition penalty).
        output_token_ids: ``[N]`` tokens generated before this row's draw (penalties,
            ``min_tokens``).
        eos_token_ids: ``[N]`` the EOS id masked while fewer than ``min_tokens`` tokens
            exist, or ``None``.
        generator: random source of unseeded rows (on the logits' device); ``None`` uses
            torch's default generator.
    """

    params: list[SamplingParams]
    seeds: list[int | None]
    positions: list[int]
    prompt_token_ids: list[Sequence[int]]
    output_token_ids: list[Sequence[int]]
    eos_token_ids: list[int | None]
    generator: torch.Generator | None = None

    def __len__(self) -> int:
        return len(self.params)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        *,
        seeds: list[int | None] | None = None,
        positions: list[int] | None = None,
        prompts: Sequence[Sequence[int]] | None = None,
        outputs: Sequence[Sequence[int]] | None = None,
        eos: list[int | None] | None = None,
        generator: torch.Generator | None = None,
    ) -> SamplingBatch:
        """A batch of ``len(params)`` rows; history defaults to none, seeds to each row's
        ``params.seed``, positions to 0, EOS to none. Lists are taken as given (not
        validated against each other: the sampler checks lengths when called). O(N)."""
        n = len(params)
        return cls(
            params=params,
            seeds=seeds if seeds is not None else [p.seed for p in params],
            positions=positions if positions is not None else [0] * n,
            prompt_token_ids=[list(t) for t in prompts] if prompts is not None else [[] for _ in range(n)],
            output_token_ids=[list(t) for t in outputs] if outputs is not None else [[] for _ in range(n)],
            eos_token_ids=eos if eos is not None else [None] * n,
            generator=generator,
        )

    def select(self, rows: Sequence[int]) -> SamplingBatch:
        """A batch of the given rows, in that order (the lists are new, their entries
        shared; the generator is the same object). O(len(rows))."""
        return SamplingBatch(
            params=[self.params[i] for i in rows],
            seeds=[self.seeds[i] for i in rows],
            positions=[self.positions[i] for i in rows],
            prompt_token_ids=[self.prompt_token_ids[i] for i in rows],
            output_token_ids=[self.output_token_ids[i] for i in rows],
            eos_token_ids=[self.eos_token_ids[i] for i in rows],
            generator=self.generator,
        )

    @property
    def max_logprobs(self) -> int:
        """Top alternatives to return per row (the largest ``logprobs`` asked), or -1 when
        no row asked for logprobs."""
        asked = [p.logprobs for p in self.params if p.logprobs is not None]
        return max(asked) if asked else -1


@attrs.define(slots=True, eq=False)
class SampleResult:
    """Tokens drawn for ``N`` rows, on the device of the logits.

    Attributes:
        token_ids: ``[N]`` int64, each in ``[0, V)``.
        logprobs: ``[N]`` float32, the chosen token's log-probability under the model's raw
            distribution (log-softmax of the logits before penalties, temperature and
            filtering); ``None`` when no row asked for logprobs.
        ranks: ``[N]`` int64, the chosen token's rank in that distribution (1 = most likely).
        top_token_ids: ``[N, K]`` int64, the ``K = min(batch.max_logprobs, V)`` most likely
            tokens, most likely first.
        top_logprobs: ``[N, K]`` float32, their log-probabilities.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    ranks: torch.Tensor | None = None
    top_token_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
