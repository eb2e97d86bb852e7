"""plan_allocation: what one BlockKVCacheManager.allocate call needs, computed without
changing any block."""

from __future__ import annotations

from deepinfer_kit.cache.prefix_state import state_of
from deepinfer_kit.cache.protocols import BlockAllocator, PrefixIndex
from deepinfer_kit.errors import InvariantError
from deepinfer_kit.request import Request

__all__ = ["plan_allocation"]


def plan_allocation(
    request: Request,
    n: int,
    num_cached: int,
    allocator: BlockAllocator,
    index: PrefixIndex | None,
    epoch: int,
) -> tuple[list[int], int, list[int]]:
    """The blocks an allocation of ``n`` more tokens for ``request`` takes.

    Args:
        request: the request; its table covers ``num_computed_tokens`` when it holds blocks.
        n: tokens to make room for (``num_new_tokens``).
        num_cached: a :meth:`match_prefix` result, used only when the request holds no
            blocks.
        allocator, index: the manager's block pool and prefix index (``None``: caching off).
        epoch: the manager's eviction count; the request's memoised match result is
            reused only while it is unchanged.

    Returns:
        ``(cached, num_new, cow)``: cached blocks to take from the index, fresh blocks to
        allocate, and table positions to copy before writing (shared or published blocks).

    Raises:
        InvariantError: negative counts, or ``num_cached`` that is not cached now.

    Changes no block or reference count; creates ``request.prefix_state`` when missing
    and clears its copy-on-write flag once writes only reach private blocks.
    O(blocks written + blocks matched).
    """
    if n < 0 or num_cached < 0:
        raise InvariantError(
            f"allocate: num_new_tokens and num_cached_tokens must be >= 0, "
            f"got {n} and {num_cached}"
        )
    P = allocator.block_size
    table = request.block_table
    cached: list[int] = []
    if table:
        start = request.num_computed_tokens
    else:
        start = num_cached
        if num_cached:
            if index is None or num_cached % P:
                raise InvariantError(
                    f"num_cached_tokens must be a match_prefix result, got {num_cached}"
                )
            st = state_of(request)
            k = num_cached // P
            if st.epoch == epoch and len(st.hits) >= k:
                cached = st.hits[:k]
            else:
                cached = index.match(
                    request.all_token_ids,
                    context=request.cache_context,
                    memo=st.keys,
                    max_blocks=k,
                    touch=False,
                )
            if len(cached) < k:
                raise InvariantError(
                    f"num_cached_tokens={num_cached} but only {len(cached) * P} tokens "
                    f"are cached now: call match_prefix again after the cache changed"
                )
    end_block = -(-(start + n) // P)
    num_new = end_block - len(table) - len(cached)
    cow: list[int] = []
    if n and table:
        st = state_of(request)
        if st.cow:
            if start >= len(table) * P:
                st.cow = False  # writes only reach fresh, private blocks from now on
            else:
                ref_count = allocator.ref_count
                for j in range(start // P, min(len(table), end_block)):
                    b = table[j]
                    if ref_count(b) > 1 or (index is not None and index.contains(b)):
                        cow.append(j)
    return cached, max(num_new, 0), cow
