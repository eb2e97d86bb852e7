"""Bookkeeping shared by the prefix indexes: published blocks, eviction policy, counters."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

from deepinfer_kit._validators import require_ints_at_least
from deepinfer_kit.cache.lru_policy import LRUEvictionPolicy
from deepinfer_kit.cache.protocols import EvictionPolicy
from deepinfer_kit.cache.records import PrefixCacheStats
from deepinfer_kit.errors import InvariantError

__all__ = ["PublishedBlocks"]

E = TypeVar("E")


class PublishedBlocks(Generic[E]):
    """Which blocks hold a published identity (``block -> entry``), which of those are
    evictable (the policy), and the counters. Subclasses add the identity structure and
    implement :meth:`_forget_all`."""

    __slots__ = ("_block_size", "_entries", "_policy", "_stats")

    def __init__(self, block_size: int, policy: EvictionPolicy | None) -> None:
        require_ints_at_least(1, block_size=block_size)
        self._block_size = block_size
        self._entries: dict[int, E] = {}
        self._policy: EvictionPolicy = LRUEvictionPolicy() if policy is None else policy
        self._stats = PrefixCacheStats()

    @property
    def block_size(self) -> int:
        """Tokens per block (``P``)."""
        return self._block_size

    @property
    def num_evictable(self) -> int:
        """Cached blocks that are unreferenced and may be evicted. O(1)."""
        return len(self._policy)

    @property
    def num_cached(self) -> int:
        """Blocks holding a published identity (referenced or not). O(1)."""
        return len(self._entries)

    @property
    def stats(self) -> PrefixCacheStats:
        """Hit / miss / insert / eviction counters (live object, cumulative)."""
        return self._stats

    def contains(self, block: int) -> bool:
        """True when the block holds a published identity. O(1)."""
        return block in self._entries

    def mark_unused(self, blocks: Sequence[int]) -> list[int]:
        """Cached ones among ``blocks`` become the most recently used evictable blocks
        (first given evicted first); returns the others, in order, for the caller to free.
        """
        entries = self._entries
        cached = [b for b in blocks if b in entries]
        rest = [b for b in blocks if b not in entries] if len(cached) < len(blocks) else []
        if cached:
            self._policy.push(cached)
        return rest

    def mark_used(self, blocks: Sequence[int]) -> None:
        """Blocks referenced again stop being evictable (others ignored)."""
        self._policy.discard(blocks)

    def evict(self, n: int) -> list[int]:
        """Forget up to ``n`` evictable blocks in the policy's order; returns them."""
        if n <= 0:
            return []
        victims = self._policy.pop(n)
        self._forget_all(victims)
        self._stats.evicted_blocks += len(victims)
        return victims

    def _query_blocks(self, tokens: Sequence[int], max_blocks: int | None) -> int:
        """Full blocks a match reads: ``len(tokens) // P``, capped by ``max_blocks``."""
        n = len(tokens) // self._block_size
        if max_blocks is not None and max_blocks < n:
            n = max(max_blocks, 0)
        return n

    def _insert_span(
        self, tokens: Sequence[int], blocks: Sequence[int], start: int
    ) -> tuple[int, int]:
        """``(len(blocks), max(start, 0))``, once ``tokens`` is known to cover the blocks
        (else InvariantError)."""
        n = len(blocks)
        if len(tokens) < n * self._block_size:
            raise InvariantError(
                f"insert: {n} blocks need {n * self._block_size} tokens, got {len(tokens)}"
            )
        return n, max(start, 0)

    def _touch_hits(self, hits: list[int], num_query_blocks: int) -> None:
        stats = self._stats
        stats.queries += 1
        stats.query_blocks += num_query_blocks
        stats.hit_blocks += len(hits)
        if hits:
            # Tail first, so the head of the chain ends up the most recently used.
            self._policy.touch(hits[::-1])

    def _forget_all(self, blocks: list[int]) -> None:
        """Drop the identities of ``blocks`` (all published); one call per eviction, so
        the per-block work stays inside one loop."""
        raise NotImplementedError
