"""SlotFastPath: BlockKVCacheManager's own ``allocate_slots``, the one-call API with fast
paths for the calls a scheduler makes most (a decode, a new request's first chunk)."""

from __future__ import annotations

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

        @property
        def num_free_blocks(self) -> int: ...
        def _evict(self, index: PrefixIndex, n: int) -> None: ...
        def match_prefix(self, request: Request) -> int: ...
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
        chunk) takes a fast path here; every other case runs the generic function."""
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
                if num_new <= 0:  # a decode inside its last block: publish at most
                    if computed // P > st.num_published:
                        self.cache_full_blocks(request, computed)
                    request.num_computed_tokens = computed
                    # tuple.__new__ skips the named tuple's Python-level __new__
                    return _tuple_new(SlotGrant, (0, computed, num_new_tokens, []))
                allocator = self._allocator
                index = self._index
                short = num_new - allocator.num_free
                if short > 0 and (index is None or short > index.num_evictable):
                    raise OutOfBlocksError(
                        f"request {request.request_id!r} needs room for {num_new_tokens} "
                        f"tokens, {self.num_free_blocks} blocks free or evictable"
                    )
                if computed // P > st.num_published:
                    self.cache_full_blocks(request, computed)
                request.num_computed_tokens = computed
                short = num_new - allocator.num_free
                if short > 0:
                    assert index is not None
                    self._evict(index, short)
                table.extend(allocator.allocate(num_new))
                return _tuple_new(SlotGrant, (0, computed, num_new_tokens, []))
        elif (
            not table
            and not (request.num_computed_tokens if num_computed_tokens is None else num_computed_tokens)
            and 0 < num_new_tokens <= request.num_tokens
        ):
            # A new (or preempted) request: take the cached prefix and allocate. allocate
            # itself changes nothing when it raises, so no separate can_allocate plan.
            before = request.num_computed_tokens
            cached = min(self.match_prefix(request), (num_new_tokens - 1) // self._P * self._P)
            request.num_computed_tokens = cached
            try:
                copies = self.allocate(request, num_new_tokens - cached, cached)
            except OutOfBlocksError:
                request.num_computed_tokens = before
                raise
            return SlotGrant(cached, cached, num_new_tokens - cached, copies)
        manager = cast("KVCacheManager", self)  # a mixin of BlockKVCacheManager
        return allocate_slots(manager, request, num_new_tokens, num_computed_tokens)
