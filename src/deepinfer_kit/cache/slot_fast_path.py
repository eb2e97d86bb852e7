"""SlotFastPath: BlockKVCacheManager's one-call fast paths — ``allocate_slots`` for the
call a scheduler makes most (a decode, or a later chunk, of a request that holds blocks),
and ``allocate_next_blocks``, a round's decode blocks in one call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from deepinfer_kit.cache.prefix_state import PrefixState as _PrefixState
from deepinfer_kit.cache.records import SlotGrant
from deepinfer_kit.cache.slots import allocate_slots
from deepinfer_kit.errors import OutOfBlocksError
from deepinfer_kit.request import Request

if TYPE_CHECKING:
    from deepinfer_kit.cache.protocols import BlockAllocator, KVCacheManager, PrefixIndex

__all__ = ["SlotFastPath"]

_tuple_new = tuple.__new__


class SlotFastPath:
    """Mixin of :class:`~deepinfer_kit.cache.manager.BlockKVCacheManager` holding its
    ``allocate_slots`` (kept apart: the manager's file holds the step-by-step API)."""

    __slots__ = ()

    if TYPE_CHECKING:  # provided by BlockKVCacheManager
        _P: int
        _allocator: BlockAllocator
        _index: PrefixIndex | None

        def _evict(self, index: PrefixIndex, n: int) -> None: ...

        @property
        def num_free_blocks(self) -> int: ...
        def _out_of_blocks(self, request: Request, needed: int) -> OutOfBlocksError: ...
        def cache_full_blocks(self, request: Request, num_tokens: int) -> None: ...
        def allocate(
            self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0
        ) -> list[tuple[int, int]]: ...

    def allocate_slots(
        self, request: Request, num_new_tokens: int, num_computed_tokens: int | None = None
    ) -> SlotGrant:
        """Publish, take the cached prefix and allocate in one call; see
        :func:`deepinfer_kit.cache.slots.allocate_slots` (same arguments, result and
        errors). A request that holds blocks and only grows (a decode, a later prefill
        chunk) takes a fast path here, without the general allocation plan; every other
        case runs the generic function."""
        table = request.block_table
        if table and num_new_tokens > 0:
            computed = (
                request.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
            )
            st: _PrefixState | None = request.prefix_state  # type: ignore[assignment]
            end = computed + num_new_tokens
            if computed > 0 and end <= len(request.all_token_ids) and st is not None and not st.cow:
                P = self._P
                num_new = (end + P - 1) // P - len(table)
                if num_new > 0 and num_new > self.num_free_blocks:
                    raise self._out_of_blocks(request, num_new)  # before anything is published
                if computed // P > st.num_published:
                    self.cache_full_blocks(request, computed)
                request.num_computed_tokens = computed
                if num_new > 0:
                    self.allocate(request, num_new_tokens)  # its own fast path: evict, extend
                # tuple.__new__ skips the named tuple's Python-level __new__
                return _tuple_new(SlotGrant, (0, computed, num_new_tokens, []))
        manager = cast("KVCacheManager", self)  # a mixin of BlockKVCacheManager
        return allocate_slots(manager, request, num_new_tokens, num_computed_tokens)

    def allocate_next_blocks(self, requests: Sequence[Request]) -> int:
        """See :meth:`KVCacheManager.allocate_next_blocks`: one fresh block onto each
        table, in order, while free plus evictable blocks last; returns how many got one.

        The blocks are those ``allocate(request, n)`` per request would give: first the
        free list in its stack order, then (when it runs dry) the index's evictions in
        its eviction order, one block each. A request's copy-on-write flag is cleared, as
        the general path clears it once writes only reach fresh blocks. O(requests)."""
        allocator = self._allocator
        index = self._index
        free = allocator.num_free
        k = len(requests)
        if k > free:
            k = min(k, free + index.num_evictable) if index is not None else free
        if k <= 0:
            return 0
        take = min(k, free)
        blocks = allocator.allocate(take) if take else []
        if k > take:
            assert index is not None
            self._evict(index, k - take)  # onto the (empty) free list, in eviction order
            fresh = allocator.allocate(k - take)
            fresh.reverse()  # one allocate per request takes each eviction as it comes
            blocks.extend(fresh)
        for j in range(k):
            req = requests[j]
            req.block_table.append(blocks[j])
            st: _PrefixState | None = req.prefix_state  # type: ignore[assignment]
            if st is not None and st.cow:
                st.cow = False
        return k
