"""TransferKV: the KV cache manager of a disaggregated instance — the real one, plus the
prompt KV a decode instance receives and the blocks a prefill instance keeps until its
KV has been sent."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from deepinfer_kit.cache.manager import BlockKVCacheManager
from deepinfer_kit.cache.protocols import KVCacheManager
from deepinfer_kit.cache.records import CacheConfig, PrefixCacheStats
from deepinfer_kit.components import BuildContext
from deepinfer_kit.errors import InvariantError
from deepinfer_kit.request import Request

__all__ = ["TransferKV", "transfer_kv"]


class TransferKV:
    """Wraps the real :class:`KVCacheManager` of one instance; the scheduler talks to it
    unchanged.

    Decode side (:meth:`expect`): a request whose prompt KV was transferred is queued with
    the prompt plus its first token (sampled by the prefill instance). Its first
    :meth:`match_prefix` reports the ``num_tokens`` transferred tokens as cached, so the
    real scheduler admits it with a one-token first chunk (that token's decode), and
    :meth:`can_allocate` / :meth:`allocate` give it fresh blocks of this pool for the
    transferred tokens and that chunk (the transfer writes them): the decode instance's
    pool pressure is real, and its prompt is never recomputed. Once its blocks are freed
    (finished, or preempted: the transferred KV is gone, and a preempted request
    recomputes what its own prefix cache does not hold, as the real engine would) the
    mark is dropped.

    Prefill side (:meth:`hold`): a finished request's blocks stay referenced (their KV is
    being sent) until :meth:`release`; preemption frees them at once, as always.

    Everything else is the inner manager's, called through.

    Args:
        inner: the real manager (``BlockKVCacheManager`` as the engine builds it).

    Attributes:
        inner: that manager; transferred_tokens: tokens received so far (decode side).
    """

    __slots__ = ("inner", "transferred_tokens", "_expected", "_hold", "_held")

    def __init__(self, inner: KVCacheManager) -> None:
        self.inner = inner
        self.transferred_tokens = 0
        self._expected: dict[str, int] = {}
        self._hold: set[str] = set()
        self._held: dict[str, Request] = {}

    # ------------------------------------------------------------- transfers

    def expect(self, request_id: str, num_tokens: int) -> None:
        """Mark ``request_id`` (queued next, holding no blocks) as arriving with the KV of
        its first ``num_tokens`` tokens (its prompt, all but the last token of its
        ``all_token_ids``). Mutates the marks; O(1).

        Raises:
            InvariantError: ``num_tokens`` < 1.
        """
        if num_tokens < 1:
            raise InvariantError(f"a transfer carries >= 1 token, got {num_tokens} for {request_id!r}")
        self._expected[request_id] = num_tokens

    def hold(self, request_id: str) -> None:
        """Keep ``request_id``'s blocks when it finishes, until :meth:`release`. Mutates
        the holds; O(1)."""
        self._hold.add(request_id)

    def release(self, request_id: str) -> None:
        """Free the blocks held for finished ``request_id`` (its KV has been sent), or
        only forget the hold when it has not finished here. Mutates the holds and the
        inner pool; O(its blocks)."""
        self._hold.discard(request_id)
        req = self._held.pop(request_id, None)
        if req is not None:
            self.inner.free(req)

    @property
    def num_held(self) -> int:
        """Finished requests whose blocks are held for a transfer. O(1)."""
        return len(self._held)

    def _transferred(self, request: Request, num_cached: int) -> bool:
        return bool(num_cached) and not request.block_table and self._expected.get(request.request_id) == num_cached

    # ------------------------------------------------------------- KVCacheManager

    @property
    def block_size(self) -> int:
        """See :meth:`KVCacheManager.block_size`."""
        return self.inner.block_size

    @property
    def num_blocks(self) -> int:
        """See :meth:`KVCacheManager.num_blocks`."""
        return self.inner.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """See :meth:`KVCacheManager.num_free_blocks` (held blocks are not free)."""
        return self.inner.num_free_blocks

    @property
    def stats(self) -> PrefixCacheStats | None:
        """The inner manager's counters (a transfer counts no query or hit)."""
        return self.inner.stats

    def check_integrity(self, requests: Iterable[Request] | None = None) -> None:
        """The inner check; the requests whose blocks are held count as holders.

        Raises:
            InvariantError: as :meth:`KVCacheManager.check_integrity`.
        """
        self.inner.check_integrity(None if requests is None else [*requests, *self._held.values()])

    def match_prefix(self, request: Request) -> int:
        """The transferred tokens for a request :meth:`expect` marked that holds no
        blocks (all but its last token; not a multiple of the block size; mutates
        nothing), else the inner match (which counts a query and refreshes recency)."""
        n = self._expected.get(request.request_id)
        if n is not None and not request.block_table:
            return min(n, request.num_tokens - 1)
        return self.inner.match_prefix(request)

    def can_allocate(self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        """See :meth:`KVCacheManager.can_allocate`; a transferred request's tokens take
        fresh blocks."""
        if self._transferred(request, num_cached_tokens):
            return self.inner.can_allocate(request, num_cached_tokens + num_new_tokens, 0)
        return self.inner.can_allocate(request, num_new_tokens, num_cached_tokens)

    def allocate(self, request: Request, num_new_tokens: int,
                 num_cached_tokens: int = 0) -> list[tuple[int, int]]:
        """See :meth:`KVCacheManager.allocate`; a transferred request gets fresh blocks
        for its transferred tokens and the new ones (counted in
        :attr:`transferred_tokens`).

        Raises:
            OutOfBlocksError, InvariantError: as the inner manager.
        """
        if self._transferred(request, num_cached_tokens):
            copies = self.inner.allocate(request, num_cached_tokens + num_new_tokens, 0)
            self.transferred_tokens += num_cached_tokens
            return copies
        return self.inner.allocate(request, num_new_tokens, num_cached_tokens)

    def allocate_next_blocks(self, requests: Sequence[Request]) -> int:
        """See :meth:`KVCacheManager.allocate_next_blocks`."""
        return self.inner.allocate_next_blocks(requests)

    def fork(self, parent: Request, child: Request) -> None:
        """See :meth:`KVCacheManager.fork`."""
        self.inner.fork(parent, child)

    def truncate(self, request: Request, num_tokens: int) -> None:
        """See :meth:`KVCacheManager.truncate`."""
        self.inner.truncate(request, num_tokens)

    def free(self, request: Request) -> None:
        """Release ``request``'s blocks, except a finished one's under :meth:`hold` (kept
        until :meth:`release`); drops its transfer mark."""
        rid = request.request_id
        self._expected.pop(rid, None)
        if rid in self._hold and request.is_finished and request.block_table:
            self._held[rid] = request
            return
        self.inner.free(request)

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """See :meth:`KVCacheManager.cache_full_blocks` (transferred blocks are published
        like computed ones: their KV is in this pool)."""
        self.inner.cache_full_blocks(request, num_tokens)

    def reset_prefix_cache(self) -> bool:
        """See :meth:`KVCacheManager.reset_prefix_cache`."""
        return self.inner.reset_prefix_cache()


def transfer_kv(ctx: BuildContext) -> TransferKV:
    """The ``components.cache_manager`` factory of a disaggregated instance: the engine's
    built-in manager for ``ctx`` (free-list pool, the prefix index
    ``ctx.config.prefix_index`` names, or none with prefix caching off) in a
    :class:`TransferKV`. Raises what :meth:`BlockKVCacheManager.create` raises."""
    assert ctx.num_blocks is not None
    config = ctx.config
    inner = BlockKVCacheManager.create(
        CacheConfig(block_size=ctx.block_size, num_blocks=ctx.num_blocks,
                    enable_prefix_caching=config.enable_prefix_caching),
        "hash" if config.prefix_index == "hash" else "radix",
    )
    return TransferKV(inner)


if TYPE_CHECKING:
    _check: type[KVCacheManager] = TransferKV
