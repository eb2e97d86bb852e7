"""Contracts of the cache package: BlockAllocator, PrefixIndex, KVCacheManager."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

from deepinfer_kit.cache.records import PrefixCacheStats
from deepinfer_kit.request import Request

__all__ = ["BlockAllocator", "PrefixIndex", "KVCacheManager"]


class BlockAllocator(Protocol):
    """Physical KV blocks with reference counts.

    A block is either *free* (on the free list, count 0) or *held* (count >= 0, off the
    free list). A held block whose count is 0 is kept only because a prefix index caches
    it; it returns to the free list through :meth:`free` once evicted.
    """

    @property
    def block_size(self) -> int:
        """Tokens per block (``P``)."""
        ...

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        ...

    @property
    def num_free(self) -> int:
        """Blocks on the free list. O(1)."""
        ...

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with reference count 1.

        Raises:
            OutOfBlocksError: fewer than ``n`` blocks are free; nothing is allocated.
            InvariantError: ``n < 0``.
        """
        ...

    def retain(self, blocks: Sequence[int]) -> None:
        """Add one reference to each held block (a prefix hit or a fork). O(len(blocks)).

        Raises:
            InvariantError: a block is free or out of range; no count changes.
        """
        ...

    def release(self, blocks: Sequence[int]) -> list[int]:
        """Drop one reference from each block.

        Returns the blocks whose count reached 0, in the order given. They stay held: the
        caller either passes them to :meth:`free` or keeps them cached (evictable).

        Raises:
            InvariantError: a block's count is already 0 or it is free; no count changes.
        """
        ...

    def free(self, blocks: Sequence[int]) -> None:
        """Return held blocks with count 0 to the free list.

        Raises:
            InvariantError: a block is referenced or already free; nothing changes.
        """
        ...

    def ref_count(self, block: int) -> int:
        """The block's reference count (0 for free or cached-unreferenced blocks)."""
        ...


class PrefixIndex(Protocol):
    """Content identity of full blocks, for reuse across requests.

    Identity follows the chain ``K_i = H(K_{i-1}, tokens of block i, context)``: a block
    matches only when every token before it and ``context`` (adapter id, cache salt,
    multimodal hash) are equal. A hit must never return a block holding other tokens.
    The index does not own reference counts: the caller tells it which cached blocks are
    unreferenced (evictable) and which are in use again.
    """

    @property
    def block_size(self) -> int:
        """Tokens per block (``P``)."""
        ...

    @property
    def num_evictable(self) -> int:
        """Cached blocks that are unreferenced and may be evicted. O(1)."""
        ...

    @property
    def stats(self) -> PrefixCacheStats:
        """Hit / miss / insert / eviction counters."""
        ...

    def match(self, tokens: Sequence[int], *, context: Hashable = None) -> list[int]:
        """The blocks caching the longest full-block prefix of ``tokens``.

        Reads only whole blocks (``len(tokens) // P`` at most). Refreshes the recency of
        the blocks returned; changes no reference count (the caller retains them, then
        calls :meth:`mark_used`). O(matched blocks).
        """
        ...

    def insert(
        self, tokens: Sequence[int], blocks: Sequence[int], *, context: Hashable = None
    ) -> list[int]:
        """Publish ``blocks`` as holding the full blocks of ``tokens``.

        ``len(tokens) >= len(blocks) * P``; block ``i`` holds tokens
        ``[i * P, (i + 1) * P)``. Call only once their KV is written (after the step that
        wrote it committed). A block whose content is already cached under another block
        is not taken. Returns the blocks newly recorded; they count as in use.
        """
        ...

    def contains(self, block: int) -> bool:
        """True when the block holds a published identity."""
        ...

    def mark_unused(self, blocks: Sequence[int]) -> None:
        """Cached blocks whose reference count fell to 0 become evictable.

        They are the most recently used evictable blocks, and among themselves are
        evicted in the order given (pass a request's blocks tail first). Non-cached
        blocks are ignored.
        """
        ...

    def mark_used(self, blocks: Sequence[int]) -> None:
        """Cached blocks that are referenced again stop being evictable."""
        ...

    def evict(self, n: int) -> list[int]:
        """Forget the identity of up to ``n`` evictable blocks, least recently used first.

        Returns the blocks evicted; the caller frees them in the allocator. Never returns
        a referenced block.
        """
        ...


class KVCacheManager(Protocol):
    """The scheduler's view of the KV cache: a request's blocks, prefix reuse, forks.

    Block addressing: token ``t`` of a request lives in block ``b = t // P`` at offset
    ``o = t % P``; its slot is ``block_table[b] * P + o``. The manager mutates
    ``request.block_table`` and ``request.prefix_state``; the scheduler owns
    ``request.num_computed_tokens``.
    """

    @property
    def block_size(self) -> int:
        """Tokens per block (``P``)."""
        ...

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        ...

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can use now: free plus evictable cached blocks."""
        ...

    def match_prefix(self, request: Request) -> int:
        """Tokens of ``request``'s prompt whose KV is cached, from the current cache.

        A multiple of ``P`` and at most ``request.num_tokens - 1`` (the last token is always
        computed so logits exist). Pure: no reference count changes. Call it at each
        scheduling attempt; never reuse a count from an earlier attempt.
        """
        ...

    def can_allocate(self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        """True when :meth:`allocate` with the same arguments would succeed."""
        ...

    def allocate(
        self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0
    ) -> list[tuple[int, int]]:
        """Make room for ``num_new_tokens`` more tokens of ``request``.

        When the request holds no blocks, its first ``num_cached_tokens`` tokens (a
        :meth:`match_prefix` result) are taken from the cache first. Afterwards
        ``request.block_table`` covers ``start + num_new_tokens`` tokens, where ``start``
        is ``num_cached_tokens`` for a request holding no blocks and
        ``request.num_computed_tokens`` otherwise. A write into a block shared with another
        request goes to a private copy.

        Returns:
            ``(src, dst)`` block copies the runner must perform before the forward.

        Raises:
            OutOfBlocksError: not enough free or evictable blocks; nothing changed.
        """
        ...

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's blocks by reference (copy-on-write on later writes)."""
        ...

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Release the request's blocks wholly beyond its first ``num_tokens`` tokens
        (speculative rollback)."""
        ...

    def free(self, request: Request) -> None:
        """Release every block of ``request``; cached ones become evictable, the rest free.

        Idempotent for a request holding no blocks.
        """
        ...

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the full blocks among the first ``num_tokens`` tokens of ``request``.

        Call only after the step that wrote their KV committed. No-op when prefix caching
        is off.
        """
        ...
