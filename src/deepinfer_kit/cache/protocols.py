"""Contracts of the cache package: BlockAllocator, EvictionPolicy, PrefixIndex, KVCacheManager."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import Any, Protocol

from deepinfer_kit.cache.records import PrefixCacheStats
from deepinfer_kit.request import Request

__all__ = ["BlockAllocator", "EvictionPolicy", "PrefixIndex", "KVCacheManager", "wrapped_chain", "wrapped_member"]


class BlockAllocator(Protocol):
    """Physical KV blocks with reference counts.

    A block is either *free* (on the free list) or *held* (off it, reference count >= 0).
    A held block whose count is 0 is kept only because a prefix index caches it; it
    returns to the free list through :meth:`free` once evicted. Every mutator either
    succeeds or raises having changed nothing.
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
        """Take ``n`` free blocks, each with reference count 1. O(n).

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
        """Drop one reference from each block. O(len(blocks)).

        Returns the blocks whose count reached 0, in the order given. They stay held: the
        caller either passes them to :meth:`free` or keeps them cached (evictable).

        Raises:
            InvariantError: a block's count is already 0 or it is free; no count changes.
        """
        ...

    def free(self, blocks: Sequence[int]) -> None:
        """Return held blocks with count 0 to the free list. O(len(blocks)).

        Raises:
            InvariantError: a block is referenced, already free, or given twice; nothing
                changes.
        """
        ...

    def make_writable(self, block: int) -> tuple[int, int | None]:
        """Copy-on-write: a block the caller may write into, in place of ``block``.

        When the caller is the only holder (count 1) returns ``(block, None)``. When the
        block is shared, takes a free block (count 1), drops the caller's reference to
        ``block`` and returns ``(new, block)``: the caller must copy ``block`` into
        ``new`` on the device before writing.

        Raises:
            OutOfBlocksError: the block is shared and no block is free; nothing changes.
            InvariantError: ``block`` is free or unreferenced.
        """
        ...

    def ref_count(self, block: int) -> int:
        """The block's reference count (0 for free or cached-unreferenced blocks). O(1).

        Raises:
            InvariantError: ``block`` is out of range.
        """
        ...


class EvictionPolicy(Protocol):
    """Order in which a prefix index evicts its unreferenced cached blocks.

    Tracks a set of blocks; the index pushes blocks that become unreferenced, discards
    those referenced again, touches those matched, and pops victims. LRU is the default
    (:class:`~deepinfer_kit.cache.lru_policy.LRUEvictionPolicy`).
    """

    def __len__(self) -> int:
        """Tracked (evictable) blocks. O(1)."""
        ...

    def push(self, blocks: Sequence[int]) -> None:
        """Start tracking ``blocks`` (none tracked yet) as the most recently used; among
        themselves the first given is the first victim. O(len(blocks))."""
        ...

    def discard(self, blocks: Sequence[int]) -> None:
        """Stop tracking ``blocks``; untracked ones are ignored. O(len(blocks))."""
        ...

    def touch(self, blocks: Sequence[int]) -> None:
        """Mark the tracked ones among ``blocks`` as used now, like :meth:`push` (first
        given is the first victim among them); untracked ones are ignored."""
        ...

    def pop(self, n: int) -> list[int]:
        """Stop tracking and return up to ``n`` victims, first victim first."""
        ...


class PrefixIndex(Protocol):
    """Content identity of full blocks, for reuse across requests.

    Identity follows the chain ``K_i = H(K_{i-1}, tokens of block i, context)``: a block
    matches only when every token before it and ``context`` (adapter id, cache salt,
    multimodal hash) are equal. A hit never returns a block holding other tokens, and
    keys are keyed hashes a client cannot predict. The index does not own reference
    counts: the caller tells it which cached blocks are unreferenced (evictable) and which
    are in use again.

    ``memo`` (all methods that take it): a list owned by the caller for one token
    sequence that only grows (one request). The index appends per-block keys to it so
    later calls on the same, longer sequence hash only the new blocks. Pass ``None`` to
    hash afresh; never share one memo between sequences or contexts.
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

    def match(
        self,
        tokens: Sequence[int],
        *,
        context: Hashable = None,
        memo: list[bytes] | None = None,
        max_blocks: int | None = None,
        touch: bool = True,
    ) -> list[int]:
        """The blocks caching the longest full-block prefix of ``tokens``.

        Reads only whole blocks, at most ``len(tokens) // P`` and at most ``max_blocks``.
        With ``touch`` it counts one query in :attr:`stats` and refreshes the recency of
        the blocks returned (the head of the chain becomes the most recently used);
        without it, it changes nothing. Changes no reference count (the caller retains
        the blocks, then calls :meth:`mark_used`). O(matched blocks + new hashes).
        """
        ...

    def insert(
        self,
        tokens: Sequence[int],
        blocks: Sequence[int],
        *,
        context: Hashable = None,
        memo: list[bytes] | None = None,
        start: int = 0,
    ) -> list[int]:
        """Publish ``blocks[start:]`` as holding the full blocks of ``tokens``.

        ``len(tokens) >= len(blocks) * P``; block ``i`` holds tokens
        ``[i * P, (i + 1) * P)``, and ``blocks[:start]`` were published (or found
        cached) by an earlier call for the same sequence. Call only once their KV is
        written (after the step that wrote it committed). A block whose identity is
        already cached under another block is not taken (the chain continues past it);
        a block already cached is left as it is. Returns the blocks newly recorded; they
        count as in use (not evictable). O(len(blocks) - start).
        """
        ...

    def contains(self, block: int) -> bool:
        """True when the block holds a published identity. O(1)."""
        ...

    def mark_unused(self, blocks: Sequence[int]) -> list[int]:
        """Blocks whose reference count fell to 0: cached ones become evictable.

        They become the most recently used evictable blocks; among themselves the first
        given is evicted first (pass a request's blocks tail first). Returns the blocks
        given that are not cached, in order: the caller frees them.
        """
        ...

    def mark_used(self, blocks: Sequence[int]) -> None:
        """Cached blocks that are referenced again stop being evictable; others are
        ignored. O(len(blocks))."""
        ...

    def evict(self, n: int) -> list[int]:
        """Forget the identity of up to ``n`` evictable blocks, in the policy's order
        (least recently used first by default).

        Returns the blocks evicted; the caller frees them in the allocator. Never returns
        a referenced block. Evicting a block whose cached descendants stay (possible
        only when a chain was published through a duplicate) leaves them unreachable
        until an equal block is published again.
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

    @property
    def stats(self) -> PrefixCacheStats | None:
        """The prefix cache's counters (queries, hits, inserts, evictions), cumulative
        since construction; ``None`` when prefix caching is off.

        Read at any time (the engine reads it after each step for its trace and metrics);
        reading mutates nothing. :meth:`match_prefix` counts a query and its hits,
        :meth:`cache_full_blocks` the blocks it publishes, :meth:`allocate` the blocks it
        evicts. The record may be live (updated in place by later calls): copy the fields
        to keep a snapshot. O(1).
        """
        ...

    def check_integrity(self, requests: Iterable[Request] | None = None) -> None:
        """Check the block accounting; for tests and debugging, never on the hot path.

        Always checks conservation: free + evictable cached + in use == ``num_blocks``.
        When ``requests`` lists every request holding blocks, also checks that each
        block's reference count equals the number of tables holding it and that no table
        holds a block twice; ``check_integrity(())`` is the idle check (every count 0).
        Call it between steps (the engine does when it goes idle), not while a step is
        half-applied. Mutates nothing. O(num_blocks + total table length).

        Raises:
            InvariantError: a broken invariant, naming what is wrong (the blocks, counts
                or request ids at fault).
        """
        ...

    def match_prefix(self, request: Request) -> int:
        """Tokens of ``request.all_token_ids`` (the prompt, plus the outputs of a preempted
        request) whose KV is cached, from the current cache.

        A multiple of ``P`` and at most ``request.num_tokens - 1`` (the last token is always
        computed so logits exist). Changes no reference count, but may count a prefix
        query and refresh the matched blocks' recency. Call it at each scheduling
        attempt; never reuse a count from an earlier attempt.
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

    def allocate_next_blocks(self, requests: Sequence[Request]) -> int:
        """One round's decode growth in one call: append one fresh, private block to the
        table of each of ``requests``, in order, for as many of them as free plus
        evictable blocks allow (the rest are left unchanged).

        For requests that hold blocks and whose writes from now on all lie past their
        current tables (a decode whose token opens a new block), it is exactly
        ``allocate(request, n)`` for each in order while ``can_allocate`` holds: the same
        blocks, evicted in the same order. The scheduler calls it during ``schedule``.

        Returns:
            How many of ``requests`` (a prefix of them) got their block.
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

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, so no later request hits what earlier ones computed
        (vLLM's ``reset_prefix_cache``; e.g. between benchmark runs replaying one prompt set).

        Called between steps, with no request holding blocks. Returns False and changes
        nothing while any block is referenced; otherwise evicts every cached block to the
        free list (``num_free_blocks`` is unchanged, every earlier :meth:`match_prefix`
        result goes stale, ``stats`` count the evictions) and returns True. True with
        prefix caching off. O(cached blocks).
        """
        ...


def wrapped_chain(cache: object) -> Iterator[object]:
    """``cache``, then each cache manager down the chain it wraps (each exposing the one
    under it as ``inner``: a hybrid cache over KV tiers). Pure."""
    while cache is not None:
        yield cache
        cache = getattr(cache, "inner", None)


def wrapped_member(cache: object, name: str) -> Any:
    """``cache``'s member ``name``, or the first one down :func:`wrapped_chain`; ``None``
    when none has it. How the scheduler and the engine find a cache's optional hooks
    (``on_arrival``, ``drain_kv_transfers``, ``close``, ...). Pure."""
    return next((m for m in (getattr(c, name, None) for c in wrapped_chain(cache)) if m is not None), None)
