"""The copy back of a step's sampled tokens and logprobs, and the per-chunk logprob maps."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer_kit.outputs import Logprob
from deepinfer_kit.sample.records import SampleResult, SamplingBatch

__all__ = ["HostLogprobs", "logprob_maps", "to_host"]

HostLogprobs = tuple[list[float], list[int], list[list[int]], list[list[float]]]
"""Per row: the chosen token's logprob and rank, the top ids and their logprobs."""


def to_host(flagged: torch.Tensor, sampled: SampleResult) -> tuple[list[int], HostLogprobs | None]:
    """The step's one copy back: the tokens (``-1`` for a non-finite row) and, when a row
    asked for logprobs, their ranks and top ids in the same int64 copy, the float
    logprobs in one more."""
    if sampled.logprobs is None or sampled.ranks is None:
        tokens: list[int] = flagged.tolist()
        return tokens, None
    n = flagged.shape[0]
    top_ids = sampled.top_token_ids
    top_lp = sampled.top_logprobs
    k = top_ids.shape[1] if top_ids is not None else 0
    ints: list[int] = torch.cat(
        [flagged, sampled.ranks] + ([top_ids.reshape(-1)] if top_ids is not None else [])
    ).tolist()
    floats: list[float] = torch.cat(
        [sampled.logprobs] + ([top_lp.reshape(-1)] if top_lp is not None else [])
    ).tolist()
    tops = [ints[2 * n + r * k : 2 * n + (r + 1) * k] for r in range(n)]
    top_floats = [floats[n + r * k : n + (r + 1) * k] for r in range(n)]
    return ints[:n], (floats[:n], ints[n : 2 * n], tops, top_floats)


def logprob_maps(
    chosen: list[int], host: HostLogprobs, row_counts: Sequence[int], sampling: SamplingBatch
) -> list[list[dict[int, Logprob]]]:
    """Per chunk, per drawn token: the chosen token's Logprob plus the asked top alternatives."""
    chosen_lp, ranks, top_ids, top_lp = host
    maps: list[list[dict[int, Logprob]]] = []
    row = 0
    for count in row_counts:
        per_chunk: list[dict[int, Logprob]] = []
        for r in range(row, row + count):
            want = sampling.params[r].logprobs
            entry: dict[int, Logprob] = {}
            if want is not None:
                for rank, (tok, lp) in enumerate(zip(top_ids[r][:want], top_lp[r][:want]), 1):
                    entry[tok] = Logprob(logprob=lp, rank=rank)
                entry[chosen[r]] = Logprob(logprob=chosen_lp[r], rank=ranks[r])
            per_chunk.append(entry)
        maps.append(per_chunk)
        row += count
    return maps
