"""A step's model inputs packed into one host buffer, copied to the device at once.

Every integer input of a forward (token ids, positions, slots, the attention layout,
the logits rows, the block tables) goes into one int64 host tensor (pinned on CUDA), so
a step costs one host-to-device copy instead of one per tensor; the device tensors the
model reads are views of the copy. Region order: ``ids [T] | positions [T] | slots [T] |
query_start_loc [R + 1] | seq_lens [R] | logits_indices [N] | block_tables [R * W] |
tail``, the tail being the caller's (the token-slot indices of an overlapped round).
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence

import attrs
import torch

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.attention.layout import step_slots
from deepinfer_kit.models.records import AttentionMetadata, ForwardBatch

__all__ = [
    "ALIGN", "InputLayout", "aligned_len", "append_tables", "int64_host", "last_token_batch",
    "pack_inputs", "unpack_inputs", "unpack_tail",
]


ALIGN = 2  # int64 elements per 16 bytes: the pointer alignment Triton specialises on


def aligned_len(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


def _pad(values: list[int]) -> None:
    """Zero-pad ``values`` so the next region starts 16-byte aligned."""
    values += [0] * (aligned_len(len(values)) - len(values))


@attrs.frozen(slots=True)
class InputLayout:
    """The shape of a packed step: ``T`` tokens, ``R`` requests, ``N`` logits rows, tables
    ``W`` blocks wide, the host lengths attention reads without a device sync, and the
    length of the caller's tail."""

    num_tokens: int
    num_requests: int
    num_logits: int
    width: int
    query_lens: list[int]
    seq_lens: list[int]
    num_tail: int = 0


def pack_inputs(
    input_ids: Sequence[int],
    positions: Sequence[int],
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    tables: Sequence[Sequence[int]],
    logits_rows: Sequence[int],
    *,
    block_size: int,
    pin_memory: bool,
    tail: Sequence[int] = (),
) -> tuple[torch.Tensor, InputLayout]:
    """Lay one step out as a single int64 host tensor (pinned when ``pin_memory``), with
    ``tail`` appended (read back with :func:`unpack_tail`); each region starts at a
    multiple of :data:`ALIGN` elements.

    Called by the runner's ``prepare`` on the host; reads only the given lists. Tables
    are padded with block 0 to the widest one. O(T + R * W + len(tail)).

    Raises:
        ConfigError: a query length is < 1 or exceeds its context, or a table is too
            short for its context.
    """
    slots = step_slots(query_lens, seq_lens, tables, block_size)
    width = max((len(t) for t in tables), default=0)
    values: list[int] = []
    for region in (input_ids, positions, slots, [0, *itertools.accumulate(query_lens)],
                   seq_lens, logits_rows):
        values += region
        _pad(values)
    append_tables(values, tables, width)
    _pad(values)
    values += tail
    layout = InputLayout(
        num_tokens=len(input_ids),
        num_requests=len(query_lens),
        num_logits=len(logits_rows),
        width=width,
        query_lens=list(query_lens),
        seq_lens=list(seq_lens),
        num_tail=len(tail),
    )
    return int64_host(values, pin_memory=pin_memory), layout


def int64_host(values: Sequence[int], *, pin_memory: bool = False) -> torch.Tensor:
    """``torch.tensor(values, dtype=torch.int64, pin_memory=pin_memory)``, built by packing
    the ints into one bytes buffer first: several times cheaper than ``torch.tensor``'s
    per-element conversion for the thousands of host ints of a large round. The result
    is a writable ``[len(values)]`` CPU tensor that owns its buffer.

    Raises:
        ConfigError: a value outside the int64 range (or not an integer).
    """
    if not values:
        return torch.empty(0, dtype=torch.int64, pin_memory=pin_memory)
    try:
        packed = bytearray(struct.pack(f"{len(values)}q", *values))
    except struct.error as exc:
        raise ConfigError(f"packed step inputs must be int64 integers: {exc}") from exc
    host = torch.frombuffer(packed, dtype=torch.int64)
    return host.pin_memory() if pin_memory else host


def append_tables(values: list[int], tables: Sequence[Sequence[int]], width: int) -> None:
    """Append each block table to ``values``, padded with block 0 to ``width`` columns."""
    if tables and min(map(len, tables)) == width:  # no padding: one flattening pass
        values += itertools.chain.from_iterable(tables)
        return
    for table in tables:
        values += table
        values += [0] * (width - len(table))


def unpack_inputs(buffer: torch.Tensor, layout: InputLayout) -> ForwardBatch:
    """The forward inputs as views of ``buffer`` (the packed tensor, on the model's device).

    Mutates nothing; the views share ``buffer``'s storage (writing a placeholder into
    ``input_ids`` writes the buffer).
    """
    t, r, n, w = layout.num_tokens, layout.num_requests, layout.num_logits, layout.width
    views: list[torch.Tensor] = []
    offset = 0
    for size in (t, t, t, r + 1, r, n, r * w):
        views.append(buffer.narrow(0, offset, size))
        offset += aligned_len(size)
    ids, positions, slots, qsl, seq, logits, tables = views
    attn = AttentionMetadata(
        slot_mapping=slots,
        block_tables=tables.view(r, w),
        query_start_loc=qsl,
        seq_lens=seq,
        max_query_len=max(layout.query_lens, default=0),
        max_seq_len=max(layout.seq_lens, default=0),
        query_lens_host=layout.query_lens,
        seq_lens_host=layout.seq_lens,
    )
    return ForwardBatch(input_ids=ids, positions=positions, attn=attn, logits_indices=logits)


def unpack_tail(buffer: torch.Tensor, layout: InputLayout) -> torch.Tensor:
    """The tail given to :func:`pack_inputs`: ``[layout.num_tail]`` int64, a view of
    ``buffer`` (on whatever device ``buffer`` is)."""
    return buffer[buffer.numel() - layout.num_tail :]


def last_token_batch(
    input_ids: Sequence[int],
    positions: Sequence[int],
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    tables: Sequence[Sequence[int]],
    *,
    block_size: int,
    device: torch.device,
) -> ForwardBatch:
    """A side forward's inputs (a drafter's rounds, warm-up), its logits rows each
    request's last token, packed on the host and copied to ``device`` once (not pinned).

    Mutates nothing. Raises what :func:`pack_inputs` raises.
    """
    ends = [end - 1 for end in itertools.accumulate(query_lens)]
    host, layout = pack_inputs(
        input_ids, positions, query_lens, seq_lens, tables, ends,
        block_size=block_size, pin_memory=False,
    )  # fmt: skip
    return unpack_inputs(host.to(device), layout)
