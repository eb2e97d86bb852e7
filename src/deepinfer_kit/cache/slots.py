"""allocate_slots: a scheduler's per-step cache work for one request in one call (publish
what committed, take the cached prefix, allocate), over any KVCacheManager."""

from __future__ import annotations

from deepinfer_kit.cache.protocols import KVCacheManager
from deepinfer_kit.cache.records import SlotGrant
from deepinfer_kit.errors import InvariantError, OutOfBlocksError
from deepinfer_kit.request import Request

__all__ = ["allocate_slots"]


def allocate_slots(
    manager: KVCacheManager,
    request: Request,
    num_new_tokens: int,
    num_computed_tokens: int | None = None,
) -> SlotGrant:
    """Make room for the next ``num_new_tokens`` tokens of ``request``, in one call.

    Called once per step for each scheduled request, before the forward. In order:

    1. ``num_computed_tokens`` (default: ``request.num_computed_tokens``) says how many of
       the request's tokens earlier, committed steps wrote; the full blocks among them are
       published (:meth:`~KVCacheManager.cache_full_blocks`), so blocks are never
       published before their KV exists.
    2. A request holding no blocks (new, or preempted) takes the longest cached prefix
       (:meth:`~KVCacheManager.match_prefix`) that ends before the chunk does: the chunk
       ``[num_computed_tokens, num_computed_tokens + num_new_tokens)`` keeps its end and
       starts after the hit, so at least its last token is computed.
    3. Blocks are allocated for the chunk (:meth:`~KVCacheManager.allocate`), and
       ``request.num_computed_tokens`` is set to where the chunk now starts.

    It equals the step-by-step calls a scheduler makes (``cache_full_blocks`` after the
    previous step, ``match_prefix``, ``allocate``). ``num_new_tokens=0`` only publishes
    (use it once the last step committed, before ``free``, to keep that step's blocks).

    Args:
        manager: the cache manager holding the request's blocks.
        request: the request; ``all_token_ids`` must hold the chunk's tokens.
        num_new_tokens: tokens to make room for, counted from ``num_computed_tokens``.
        num_computed_tokens: tokens whose KV committed steps wrote (0 for a request
            holding no blocks).

    Returns:
        The :class:`SlotGrant`: cached tokens taken, where the chunk starts, its length,
        and the block copies to run before the forward.

    Raises:
        OutOfBlocksError: not enough free or evictable blocks; nothing was published or
            allocated and ``request.num_computed_tokens`` is unchanged.
        InvariantError: negative counts, a chunk beyond ``request.num_tokens``, or computed
            tokens for a request holding no blocks.
    """
    before = request.num_computed_tokens
    computed = before if num_computed_tokens is None else num_computed_tokens
    end = computed + num_new_tokens
    if computed < 0 or num_new_tokens < 0 or end > request.num_tokens:
        raise InvariantError(
            f"allocate_slots: need 0 <= num_computed_tokens ({computed}) and 0 <= num_new_tokens "
            f"({num_new_tokens}) with their sum <= the request's {request.num_tokens} tokens"
        )
    cached = 0
    if not request.block_table:
        if computed:
            raise InvariantError(
                f"allocate_slots: request {request.request_id!r} holds no blocks but "
                f"num_computed_tokens={computed}"
            )
        if end:
            P = manager.block_size
            cached = min(manager.match_prefix(request), (end - 1) // P * P)
    start = cached if not request.block_table else computed
    request.num_computed_tokens = start
    publish = bool(request.block_table) and computed > 0
    if publish and end > start and not manager.can_allocate(request, end - start, cached):
        # Checked first only when something would be published before the allocation;
        # otherwise allocate itself raises having changed nothing (one plan, not two).
        request.num_computed_tokens = before
        raise OutOfBlocksError(
            f"request {request.request_id!r} needs room for {end - start} tokens, "
            f"{manager.num_free_blocks} blocks free or evictable"
        )
    if publish:
        manager.cache_full_blocks(request, computed)
    try:
        copies = manager.allocate(request, end - start, cached) if end > start else []
    except OutOfBlocksError:
        request.num_computed_tokens = before
        raise
    return SlotGrant(cached, start, end - start, copies)
