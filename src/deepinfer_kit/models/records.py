"""Records of the models package: one step's flattened batch, as the model reads it.

Shape symbols: ``T`` tokens in the step, ``R`` requests, ``N`` rows whose logits are
returned, ``P`` block size, ``NB`` blocks in the pool.
"""

from __future__ import annotations

import attrs
import torch

__all__ = ["AttentionMetadata", "ForwardBatch"]


@attrs.define(slots=True, eq=False)
class AttentionMetadata:
    """Where each request's new tokens sit in the batch and its KV in the pool.

    Request ``r`` owns the new tokens ``query_start_loc[r] : query_start_loc[r + 1]``; their
    positions are ``seq_lens[r] - query_len_r ... seq_lens[r] - 1`` (the first
    ``seq_lens[r] - query_len_r`` tokens are already in the cache). All tensors are on the
    model's device.

    Attributes:
        slot_mapping: ``[T]`` int64, cache slot of each new token (``block * P + offset``).
        block_tables: ``[R, max_blocks]`` int32 or int64 physical block ids, padded with 0
            (rows may be strided views: read them through ``stride(0)``).
        query_start_loc: ``[R + 1]`` int32 or int64 cumulative new-token counts (starts at 0).
        seq_lens: ``[R]`` int32 or int64 context length after this step (cached + new).
        max_query_len: the largest query length (host int).
        max_seq_len: the largest ``seq_lens`` entry (host int).
        query_lens_host: ``[R]`` query lengths as host ints (no device sync to read them).
        seq_lens_host: ``[R]`` context lengths as host ints.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_lens_host: list[int]
    seq_lens_host: list[int]

    @property
    def num_requests(self) -> int:
        """``R``."""
        return len(self.seq_lens_host)

    @property
    def is_decode_only(self) -> bool:
        """True when every request computes exactly one new token."""
        return self.max_query_len == 1


@attrs.define(slots=True, eq=False)
class ForwardBatch:
    """The inputs of one forward over a flattened batch.

    Attributes:
        input_ids: ``[T]`` int64 token ids.
        positions: ``[T]`` int64 position of each token in its sequence.
        attn: the attention layout.
        logits_indices: ``[N]`` int64, rows of ``T`` whose logits the forward returns.
        real_rows: ``[T]`` bool on the batch's device, False for a padded row of a static
            decode round (computed and dropped: its routed MoE copies are not counted in
            the layers' expert counts, nor balanced by a replica selector); ``None``: every
            row is real.
        shared_rows: ``[K]`` int64 rows whose full-attention K/V the cache already holds
            (a bounded replay's rows before its prefix hit): the full layers read it and
            write theirs to the pad slot, the sliding-window layers write theirs; ``None``:
            every row writes everywhere.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    logits_indices: torch.Tensor
    real_rows: torch.Tensor | None = None
    shared_rows: torch.Tensor | None = None
