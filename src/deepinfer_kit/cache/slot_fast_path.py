"""SlotFastPath: BlockKVCacheManager's own ``allocate_slots``, the one-call API with fast
path for the call a scheduler makes most (a decode, or a later chunk, of a request that
holds blocks)."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from deepinfer_kit.cache.prefix_state import PrefixState as _PrefixState
from deepinfer_kit.cache.records import SlotGrant
from deepinfer_kit.cache.slots import allocate_slots
from deepinfer_kit.errors import OutOfBlocksError
from deepinfer_kit.request import Request

if TYPE_CHECKING:
    from deepinfer_kit.cache.protocols import KVCacheManager

__all__ = ["SlotFastPath"]

_tuple_new = tuple.__new__


class SlotFastPath:
    """Mixin of :class:`~deepinfer_kit.cache.manager.BlockKVCacheManager` holding its
    ``allocate_slots`` (kept apart: the manager's file holds the step-by-step API)."""

    __slots__ = ()

    if TYPE_CHECKING:  # provided by BlockKVCacheManager
        _P: int

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
