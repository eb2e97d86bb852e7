"""Build AttentionMetadata from host lists (block tables, query and context lengths).

Used by model runners, tests and benchmarks that hold a batch as Python ints; computes the
slot mapping by the addressing rule ``slot = table[t // P] * P + t % P``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.records import AttentionMetadata

__all__ = ["make_attention_metadata", "slots_for", "step_slots"]


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


def step_slots(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
) -> list[int]:
    """The cache slot of every new token of a step, requests in order (``[T]`` host ints).

    Request ``r`` writes positions ``[seq_lens[r] - query_lens[r], seq_lens[r])``. O(T).

    Raises:
        ConfigError: a query length is < 1 or exceeds its context, or a table is too
            short.
    """
    P = block_size
    if seq_lens and query_lens.count(1) == len(query_lens) == len(seq_lens) and min(seq_lens) >= 1:
        try:  # a round of decodes: one slot each, a comprehension (a short table: the loop's error)
            return [table[(s - 1) // P] * P + (s - 1) % P for s, table in zip(seq_lens, block_tables)]
        except IndexError:
            pass
    slots: list[int] = []
    for q, s, table in zip(query_lens, seq_lens, block_tables):
        if q == 1 and 1 <= s <= len(table) * P:  # decode, valid: one slot, no list
            slots.append(table[(s - 1) // P] * P + (s - 1) % P)
            continue
        if not 1 <= q <= s:
            raise ConfigError(f"query_lens entries must be in [1, seq_len={s}], got {q}")
        slots += slots_for(table, s - q, s, P)
    return slots


def make_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    *,
    pin_memory: bool = False,
) -> AttentionMetadata:
    """The layout of a step where request ``r`` computes its last ``query_lens[r]`` tokens.

    Called by ``ModelRunner.prepare`` every step (and by tests and benchmarks); O(T + R *
    max_blocks) host work and one host-to-device copy per tensor.

    Args:
        query_lens: ``[R]`` new tokens per request (``>= 1``).
        seq_lens: ``[R]`` context length after the step (``>= query_lens[r]``).
        block_tables: ``R`` lists of physical block ids, each covering its ``seq_lens``.
        block_size: ``P``.
        device: where the tensors go.
        pin_memory: stage the host tensors in pinned memory and copy them without blocking
            (only for a CUDA ``device``).

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
    slots = step_slots(query_lens, seq_lens, block_tables, block_size)
    starts = [0, *itertools.accumulate(query_lens)]
    width = max((len(t) for t in block_tables), default=0)
    flat: list[int] = []
    for t in block_tables:
        flat.extend(t)
        flat.extend([0] * (width - len(t)))
    dev = torch.device(device)

    def to_device(values: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        if pin_memory:
            return torch.tensor(values, dtype=dtype, pin_memory=True).to(dev, non_blocking=True)
        return torch.tensor(values, dtype=dtype, device=dev)

    seq_list = list(seq_lens)
    return AttentionMetadata(
        slot_mapping=to_device(slots, torch.int64),
        block_tables=to_device(flat, torch.int32).view(len(block_tables), width),
        query_start_loc=to_device(starts, torch.int32),
        seq_lens=to_device(seq_list, torch.int32),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_list, default=0),
        query_lens_host=list(query_lens),
        seq_lens_host=seq_list,
    )
