"""ClaimedBlocks: the physical blocks of transformers' paged cache, handed to the kit's
block manager, and the block tables written back for transformers' attention."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deepinfer_kit.errors import ConfigError

__all__ = ["ClaimedBlocks"]


class ClaimedBlocks:
    """Every block of a ``PagedAttentionCache``'s full-attention allocator, claimed once.

    transformers' allocator keys its bookkeeping by request id and lengths only, so it
    cannot know which tokens a block holds; prefix identity, reference counts and
    eviction therefore live in the kit's :class:`~deepinfer_kit.cache.BlockKVCacheManager`,
    which numbers blocks ``0 .. num_blocks - 1``. This glue takes all of the allocator's
    sectors and blocks out of transformers' pool at construction (so transformers' own
    allocation paths find nothing to hand out), maps kit block ``k`` to physical block
    ``physical[k]``, and writes each scheduled request's table into the allocator, whose
    read/write-index code then lays out attention exactly as for its own tables.

    Args:
        cache: a transformers ``PagedAttentionCache`` whose only attention type is full
            attention; mutated (its pool is emptied) and used for the device copies.

    Raises:
        ConfigError: the cache holds another attention type (sliding window), or its
            pool already handed blocks out.
    """

    __slots__ = ("_allocator", "_physical")

    def __init__(self, cache: Any) -> None:
        allocators: dict[str, Any] = cache.cache_allocators
        if list(allocators) != ["full_attention"]:
            raise ConfigError(
                f"cache attention types must be ['full_attention'] (sliding-window layers "
                f"are not covered), got {list(allocators)}"
            )
        allocator = allocators["full_attention"]
        if allocator.block_table:
            raise ConfigError(
                f"cache must be unused, got {len(allocator.block_table)} requests holding blocks"
            )
        pool = cache.pool
        while pool.num_free_sectors:
            pool.allocate_sector(allocator.index)
        free = pool.count_free_blocks(allocator.index)
        self._physical: list[int] = sorted(pool.get_free_blocks(allocator.index, free))
        if not self._physical:
            raise ConfigError("cache must have at least one free block, got 0")
        self._allocator = allocator

    @property
    def block_size(self) -> int:
        """Tokens per block (transformers' ``page_size``)."""
        return int(self._allocator.tokens_per_page)

    @property
    def num_blocks(self) -> int:
        """Blocks claimed (the kit manager's pool size)."""
        return len(self._physical)

    def physical(self, table: Sequence[int]) -> list[int]:
        """The physical block ids of a kit block table (same order). Pure."""
        phys = self._physical
        return [phys[b] for b in table]

    def bind(self, request_id: str, table: Sequence[int]) -> None:
        """Write ``request_id``'s table (kit ids) into the allocator, replacing any
        earlier one; called for every scheduled chunk, before the batch is laid out."""
        self._allocator.block_table[request_id] = self.physical(table)

    def unbind(self, request_id: str) -> None:
        """Forget ``request_id``'s table in the allocator (idempotent). The kit manager,
        not transformers' pool, takes the blocks back."""
        self._allocator.block_table.pop(request_id, None)

    def unbind_all(self) -> None:
        """Forget every table, so transformers' ``free_all_requests`` frees nothing of
        the kit's into its own pool."""
        self._allocator.block_table.clear()

    def copy(self, copies: Sequence[tuple[int, int]]) -> None:
        """Perform the kit's copy-on-write ``(src, dst)`` block copies (kit ids) on the
        cache tensor, every layer at once; call before the forward that writes ``dst``."""
        if copies:
            src = self.physical([s for s, _ in copies])
            dst = self.physical([d for _, d in copies])
            self._allocator.copy_blocks(src, dst)
