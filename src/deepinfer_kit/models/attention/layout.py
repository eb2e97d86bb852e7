"""Build AttentionMetadata from host lists (block tables, query and context lengths).

Used by model runners, tests and benchmarks that hold a batch as Python ints; computes the
slot mapping by the addressing rule ``slot = table[t // P] * P + t % P``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.records import AttentionMetadata

__all__ = ["make_attention_metadata", "slots_for"]


def slots_for(table: Sequence[int], start: int, stop: int, block_size: int) -> list[int]:
    """Slots of positions ``[start, stop)`` of a request with block table ``table``.

    Raises:
        ConfigError: the table has fewer than ``ceil(stop / P)`` blocks.
    """
    if stop > len(table) * block_size:
        raise ConfigError(
            f"block table of {len(table)} blocks of {block_size} cannot hold position {stop - 1}"
        )
    return [table[t // block_size] * block_size + t % block_size for t in range(start, stop)]


def make_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """The layout of a step where request ``r`` computes its last ``query_lens[r]`` tokens.

    Args:
        query_lens: ``[R]`` new tokens per request (``>= 1``).
        seq_lens: ``[R]`` context length after the step (``>= query_lens[r]``).
        block_tables: ``R`` lists of physical block ids, each covering its ``seq_lens``.
        block_size: ``P``.
        device: where the tensors go.

    Returns:
        Metadata whose ``block_tables`` is padded with 0 to the longest table.

    Raises:
        ConfigError: lengths disagree, a query length is < 1 or exceeds its context, or
            a table is too short.
    """
    if not len(query_lens) == len(seq_lens) == len(block_tables):
        raise ConfigError(
            f"query_lens, seq_lens and block_tables must have one entry per request, got "
            f"{len(query_lens)}, {len(seq_lens)}, {len(block_tables)}"
        )
    slots: list[int] = []
    starts = [0]
    for q, s, table in zip(query_lens, seq_lens, block_tables):
        if not 1 <= q <= s:
            raise ConfigError(f"query_lens entries must be in [1, seq_len={s}], got {q}")
        slots += slots_for(table, s - q, s, block_size)
        starts.append(starts[-1] + q)
    width = max((len(t) for t in block_tables), default=0)
    padded = [list(t) + [0] * (width - len(t)) for t in block_tables]
    dev = torch.device(device)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=dev).view(len(padded), width),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=dev),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_lens_host=list(query_lens),
        seq_lens_host=list(seq_lens),
    )
