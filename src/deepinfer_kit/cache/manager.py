"""BlockKVCacheManager: the scheduler's view of the KV cache, composed from an injected
BlockAllocator and an optional PrefixIndex."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal

from deepinfer_kit.cache.alloc_plan import plan_allocation
from deepinfer_kit.cache.integrity import check_block_accounting
from deepinfer_kit.cache.prefix_state import PrefixState as _PrefixState
from deepinfer_kit.cache.prefix_state import state_of as _state
from deepinfer_kit.cache.protocols import BlockAllocator, PrefixIndex
from deepinfer_kit.cache.records import CacheConfig, PrefixCacheStats
from deepinfer_kit.cache.slot_fast_path import SlotFastPath
from deepinfer_kit.errors import ConfigError, InvariantError, OutOfBlocksError
from deepinfer_kit.request import Request

__all__ = ["BlockKVCacheManager"]


class BlockKVCacheManager(SlotFastPath):
    """Block tables, prefix reuse, forks with copy-on-write, on injected components.

    Token ``t`` of a request lives at slot ``block_table[t // P] * P + t % P``. The
    manager owns ``request.block_table`` and ``request.prefix_state`` (block-key memo,
    publish progress); it reads ``request.num_computed_tokens`` (owned by the scheduler),
    ``request.all_token_ids`` (must only grow) and ``request.cache_context`` (part of
    every prefix key). Released blocks that the index caches stay evictable; the others
    return to the free list.

    Args:
        allocator: the block pool.
        index: the prefix index, or ``None`` to turn prefix caching off.

    Raises:
        ConfigError: the index's block size differs from the allocator's.
    """

    __slots__ = ("_allocator", "_index", "_P", "_epoch")

    def __init__(self, allocator: BlockAllocator, index: PrefixIndex | None) -> None:
        if index is not None and index.block_size != allocator.block_size:
            raise ConfigError(
                f"index.block_size must equal allocator.block_size "
                f"({allocator.block_size}), got {index.block_size}"
            )
        self._allocator = allocator
        self._index = index
        self._P = allocator.block_size
        # Evictions so far: only an eviction can un-cache a block (the manager is the
        # index's only mutator), so a match result stays valid while this is unchanged.
        self._epoch = 0

    @classmethod
    def create(
        cls, config: CacheConfig, index: Literal["hash", "radix"] = "radix"
    ) -> BlockKVCacheManager:
        """A manager over a :class:`FreeListBlockAllocator` and, when
        ``config.enable_prefix_caching``, a :class:`RadixPrefixIndex` (``"radix"``, the
        default: the faster of the two on every measured trace, see
        docs/prefix_reuse.md) or a :class:`HashChainPrefixIndex` (``"hash"``) with LRU
        eviction and a random key.

        Raises:
            ConfigError: ``index`` is not ``"hash"`` or ``"radix"``.
        """
        from deepinfer_kit.cache.free_list_allocator import FreeListBlockAllocator
        from deepinfer_kit.cache.hash_chain_index import HashChainPrefixIndex
        from deepinfer_kit.cache.radix_index import RadixPrefixIndex

        if index not in ("hash", "radix"):
            raise ConfigError(f"index must be one of ['hash', 'radix'], got {index!r}")
        allocator = FreeListBlockAllocator(config.num_blocks, config.block_size)
        idx: PrefixIndex | None = None
        if config.enable_prefix_caching:
            idx = (HashChainPrefixIndex if index == "hash" else RadixPrefixIndex)(
                config.block_size
            )
        return cls(allocator, idx)

    @property
    def allocator(self) -> BlockAllocator:
        """The injected block pool (read it; mutate only through the manager)."""
        return self._allocator

    @property
    def index(self) -> PrefixIndex | None:
        """The injected prefix index, or ``None`` when prefix caching is off."""
        return self._index

    @property
    def block_size(self) -> int:
        """Tokens per block (``P``)."""
        return self._P

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self._allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Free plus evictable cached blocks. O(1)."""
        index = self._index
        free = self._allocator.num_free
        return free + index.num_evictable if index is not None else free

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests (0.0 idle, 1.0 full)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def stats(self) -> PrefixCacheStats | None:
        """The index's counters (live), or ``None`` when prefix caching is off. O(1)."""
        return self._index.stats if self._index is not None else None

    def match_prefix(self, request: Request) -> int:
        """Tokens of ``request.all_token_ids`` cached now: a multiple of ``P``, at most
        ``num_tokens - 1``; 0 for a request asking for prompt logprobs. Counts one index query and refreshes the matched blocks'
        recency; changes no reference count. O(matched blocks + newly hashed blocks)."""
        index = self._index
        if index is None or request.params.prompt_logprobs is not None:
            return 0  # prompt logprobs need every prompt position computed (as vLLM)
        tokens = request.all_token_ids
        limit = (len(tokens) - 1) // self._P
        if limit <= 0:
            return 0
        st = _state(request)
        hits = index.match(tokens, context=request.cache_context, memo=st.keys, max_blocks=limit)
        st.hits = hits
        st.epoch = self._epoch
        return len(hits) * self._P

    def _can_take(self, cached: list[int], needed: int) -> bool:
        allocator = self._allocator
        free = allocator.num_free
        if needed <= free:
            return True
        index = self._index
        if index is None:
            return False
        # Cached blocks taken now leave the evictable pool (count them only when it matters).
        if needed <= free + index.num_evictable - len(cached):
            return True
        ref_count = allocator.ref_count
        taken = sum(1 for b in cached if ref_count(b) == 0)
        return needed <= free + index.num_evictable - taken

    def can_allocate(self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        """True when :meth:`allocate` with the same arguments would succeed now. Pure.

        Raises:
            InvariantError: as :meth:`allocate` for arguments it would reject.
        """
        num_new = self._plain_growth(request, num_new_tokens)
        if num_new >= 0:  # allocate's fast path, as a question
            if num_new == 0:
                return True
            index = self._index
            free = self._allocator.num_free
            return num_new <= (free + index.num_evictable if index is not None else free)
        cached, num_new, cow = plan_allocation(
            request, num_new_tokens, num_cached_tokens, self._allocator, self._index, self._epoch
        )
        return self._can_take(cached, num_new + len(cow))

    def allocate(
        self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0
    ) -> list[tuple[int, int]]:
        """Cover ``start + num_new_tokens`` tokens with blocks (see
        :meth:`KVCacheManager.allocate`), evicting cached blocks LRU-first when the free
        list runs short. A write into a shared block (after :meth:`fork`) or into a
        published block (after :meth:`truncate`) goes to a private copy.

        Returns:
            ``(src, dst)`` block copies to perform on the device before the forward.

        Raises:
            OutOfBlocksError: not enough free plus evictable blocks; nothing changed.
            InvariantError: negative counts, or ``num_cached_tokens`` that is not cached
                now (a stale :meth:`match_prefix` result); nothing changed.
        """
        num_new = self._plain_growth(request, num_new_tokens)
        if num_new >= 0:  # fast path (decode, later prefill chunks)
            if num_new == 0:
                return []
            allocator = self._allocator
            short = num_new - allocator.num_free
            if short > 0:
                index = self._index
                if index is None or short > index.num_evictable:
                    raise self._out_of_blocks(request, num_new)
                self._evict(index, short)
            request.block_table.extend(allocator.allocate(num_new))
            return []
        table = request.block_table
        cached, num_new, cow = plan_allocation(
            request, num_new_tokens, num_cached_tokens, self._allocator, self._index, self._epoch
        )
        needed = num_new + len(cow)
        if not self._can_take(cached, needed):
            raise self._out_of_blocks(request, needed)
        allocator = self._allocator
        index = self._index
        _state(request)  # the fast paths rely on it once the request holds blocks
        if cached:
            assert index is not None
            allocator.retain(cached)
            index.mark_used(cached)
            table.extend(cached)
            _state(request).num_published = len(cached)
        short = needed - allocator.num_free
        if short > 0:
            assert index is not None
            self._evict(index, short)
        if num_new:
            table.extend(allocator.allocate(num_new))
        if not cow:
            return []
        return self._copy_on_write(request, cow)

    def _plain_growth(self, request: Request, num_new_tokens: int) -> int:
        """Fresh blocks ``request`` needs for ``num_new_tokens`` more tokens (0 or more)
        when that is all the allocation does — it holds blocks, takes no prefix and no
        copy is due — else -1 (the general :func:`plan_allocation` path)."""
        table = request.block_table
        if not table or num_new_tokens <= 0:
            return -1
        # A request holding blocks has this manager's state (or None after a reset).
        st: _PrefixState | None = request.prefix_state  # type: ignore[assignment]
        if st is not None and st.cow:
            return -1
        P = self._P
        num_new = (request.num_computed_tokens + num_new_tokens + P - 1) // P - len(table)
        return num_new if num_new > 0 else 0

    def _evict(self, index: PrefixIndex, n: int) -> None:
        """Evict ``n`` cached blocks onto the free list; every match result taken before
        becomes stale (the epoch moves)."""
        self._allocator.free(index.evict(n))
        self._epoch += 1

    def _out_of_blocks(self, request: Request, needed: int) -> OutOfBlocksError:
        return OutOfBlocksError(
            f"request {request.request_id!r} needs {needed} blocks, "
            f"{self.num_free_blocks} free or evictable"
        )

    def _copy_on_write(self, request: Request, positions: list[int]) -> list[tuple[int, int]]:
        allocator = self._allocator
        table = request.block_table
        st = _state(request)
        copies: list[tuple[int, int]] = []
        for j in positions:
            old = table[j]
            if allocator.ref_count(old) > 1:
                new, _ = allocator.make_writable(old)
            else:
                # Sole holder of a published block: keep the cached content intact.
                (new,) = allocator.allocate(1)
                self._release([old])
            table[j] = new
            copies.append((old, new))
            if st.num_published > j:
                st.num_published = j
        return copies

    def _release(self, blocks: list[int]) -> None:
        """Drop one reference from each block (pass tail first); cached blocks reaching
        0 become evictable in that order, the others are freed."""
        zero = self._allocator.release(blocks)
        if zero:
            if self._index is not None:
                zero = self._index.mark_unused(zero)
            if zero:
                self._allocator.free(zero)

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` (holding no blocks) every block of ``parent`` by reference.

        Both later copy a shared block before writing into it (see :meth:`allocate`).
        The child also inherits the parent's block-key memo and publish progress.

        Raises:
            InvariantError: ``child`` holds blocks or is ``parent``.
        """
        if child is parent or child.block_table:
            raise InvariantError(
                f"fork: child {child.request_id!r} must be a different request holding no blocks"
            )
        table = parent.block_table
        if table:
            self._allocator.retain(table)
        child.block_table = list(table)
        pst = _state(parent)
        child.prefix_state = _PrefixState(list(pst.keys), pst.num_published, True)
        pst.cow = True

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Release the blocks wholly beyond the first ``num_tokens`` tokens, tail first
        (speculative rollback). A later write into a kept block that is shared or
        published goes to a copy.

        Raises:
            InvariantError: ``num_tokens < 0``.
        """
        if num_tokens < 0:
            raise InvariantError(f"truncate: num_tokens must be >= 0, got {num_tokens}")
        keep = -(-num_tokens // self._P)
        table = request.block_table
        if keep >= len(table):
            return
        tail = table[keep:]
        del table[keep:]
        tail.reverse()
        self._release(tail)
        st = _state(request)
        st.num_published = min(st.num_published, keep)
        st.cow = True

    def free(self, request: Request) -> None:
        """Release every block of ``request`` (tail first, so its tail is evicted before
        its head). Idempotent for a request holding no blocks."""
        table = request.block_table
        if table:
            request.block_table = []
            self._release(table[::-1])
        st = request.prefix_state
        if type(st) is _PrefixState:
            st.num_published = 0
            st.cow = False

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the full blocks among the first ``num_tokens`` tokens of ``request``
        not published yet. Call only after the step that wrote their KV committed.
        No-op when prefix caching is off. O(newly full blocks).

        Raises:
            InvariantError: ``request.all_token_ids`` holds fewer than ``num_tokens``
                tokens' worth of full blocks.
        """
        index = self._index
        if index is None:
            return
        n_full = num_tokens // self._P
        st: _PrefixState | None = request.prefix_state  # type: ignore[assignment]
        if st is not None:
            if n_full <= st.num_published:
                return
        else:
            st = _state(request)
        table = request.block_table
        if n_full > len(table):
            n_full = len(table)
            if n_full <= st.num_published:
                return
        index.insert(
            request.all_token_ids,
            table if n_full == len(table) else table[:n_full],
            context=request.cache_context,
            memo=st.keys,
            start=st.num_published,
        )
        st.num_published = n_full

    def reset_prefix_cache(self) -> bool:
        """Evict every cached block when no block is referenced; False (nothing changed)
        otherwise. See :meth:`KVCacheManager.reset_prefix_cache`. O(cached blocks)."""
        index = self._index
        evictable = index.num_evictable if index is not None else 0
        if self._allocator.num_free + evictable != self._allocator.num_blocks:
            return False
        if index is not None and evictable:
            self._evict(index, evictable)
        return True

    def check_integrity(self, requests: Iterable[Request] | None = None) -> None:
        """Conservation (free + evictable + in use == total) and, when ``requests`` lists
        every request holding blocks, reference counts equal to holders and no block
        twice in a table. ``check_integrity(())`` is the idle check. O(num_blocks).

        Raises:
            InvariantError: naming the blocks at fault.
        """
        check_block_accounting(self._allocator, self._index, requests)


if TYPE_CHECKING:
    from deepinfer_kit.cache.protocols import KVCacheManager

    _check: type[KVCacheManager] = BlockKVCacheManager
