"""The vocabulary-parallel embedding and LM head: each rank holds ``ceil(V / T)`` rows of
the (possibly tied) vocabulary matrix; lookups are summed over the ranks, logits gathered
once, before sampling."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from deepinfer_kit.comm.protocols import Communicator
from deepinfer_kit.models.parallel.shard import VocabShard
from deepinfer_kit.models.weights import take_slice

__all__ = ["embed_vocab_parallel", "gather_logits", "load_vocab_rows"]


def embed_vocab_parallel(ids: torch.Tensor, weight: torch.Tensor, shard: VocabShard,
                         comm: Communicator) -> torch.Tensor:
    """Token embeddings when each rank holds rows ``shard``: the owner of each id looks it
    up, the others contribute zeros, one all-reduce sums them (exact: one nonzero term).

    Args:
        ids: ``[T]`` int64 token ids in ``[0, V)``.
        weight: ``[Vl, H]`` this rank's rows.

    Returns:
        ``[T, H]`` in the dtype of ``weight``, the same on every rank.

    Raises:
        CollectiveError: the all-reduce failed or timed out.
    """
    local = ids - shard.start
    mine = (local >= 0) & (local < shard.real)
    out = F.embedding(torch.where(mine, local, torch.zeros_like(local)), weight)
    out = out * mine.unsqueeze(1).to(out.dtype)
    return comm.all_reduce(out)


def gather_logits(hidden: torch.Tensor, weight: torch.Tensor, shard: VocabShard,
                  comm: Communicator) -> torch.Tensor:
    """``[N, H]`` final hidden states -> ``[N, V]`` float32 logits: this rank's ``[N, Vl]``,
    all-gathered along the vocabulary and trimmed of the padding rows.

    Raises:
        CollectiveError: the all-gather failed or timed out.
    """
    local = F.linear(hidden.to(weight.dtype), weight).float()
    return comm.all_gather(local, 1)[:, : shard.vocab_size]


def load_vocab_rows(weight: torch.Tensor, weights: Mapping[str, torch.Tensor], name: str,
                    shard: VocabShard) -> None:
    """Fill ``weight`` (``[Vl, H]``) with rows ``shard`` of ``name`` (``[V, H]``), reading
    only those rows; padding rows become zeros.

    Raises:
        CheckpointError: the tensor is missing or mis-shaped (named).
    """
    shape = (shard.vocab_size, weight.shape[1])
    with torch.no_grad():
        weight.zero_()
        if shard.real:
            weight[: shard.real].copy_(
                take_slice(weights, name, shape, 0, shard.start, shard.start + shard.real))
