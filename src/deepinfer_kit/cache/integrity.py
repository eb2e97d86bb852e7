"""Block accounting checks over an allocator, an index and the requests holding blocks."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from deepinfer_kit.cache.protocols import BlockAllocator, PrefixIndex
from deepinfer_kit.errors import InvariantError
from deepinfer_kit.request import Request

__all__ = ["check_block_accounting"]


def check_block_accounting(
    allocator: BlockAllocator, index: PrefixIndex | None, requests: Iterable[Request] | None
) -> None:
    """Check conservation (free + evictable + in use == total) and, when ``requests``
    lists every request holding blocks, that each block's reference count equals the
    number of tables holding it and no table holds a block twice. Pass ``()`` for the
    idle check (every count 0). O(num_blocks + table sizes).

    Raises:
        InvariantError: naming the blocks at fault.
    """
    total = allocator.num_blocks
    refs = [allocator.ref_count(b) for b in range(total)]
    in_use = sum(1 for r in refs if r > 0)
    evictable = index.num_evictable if index is not None else 0
    if allocator.num_free + evictable + in_use != total:
        raise InvariantError(
            f"conservation broken: free {allocator.num_free} + evictable {evictable} "
            f"+ in use {in_use} != {total}"
        )
    if requests is None:
        return
    held: Counter[int] = Counter()
    for r in requests:
        if len(set(r.block_table)) != len(r.block_table):
            raise InvariantError(f"request {r.request_id!r} holds a block twice: {r.block_table}")
        held.update(r.block_table)
    wrong = {b: (refs[b], held[b]) for b in range(total) if refs[b] != held[b]}
    if wrong:
        raise InvariantError(
            "reference counts differ from tables (block: (count, holders)): "
            + ", ".join(f"{b}: {v}" for b, v in sorted(wrong.items())[:20])
        )
