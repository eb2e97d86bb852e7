"""What the model-running drafters share: the row of one request drafted in a round, how
many drafts a request gets and which requests draft (:func:`plan_rows`), the release of
their per-sequence KV (:class:`OwnKVState`), and the check that a drafter's KV pool and its
book describe the same blocks."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.errors import ConfigError, OutOfBlocksError
from deepinfer_kit.spec.protocols import DraftSequence
from deepinfer_kit.spec.drafters.draft_kv import DraftKVBook

__all__ = ["DraftRow", "OwnKVState", "draft_depth", "plan_rows", "check_draft_pool"]


@attrs.define(slots=True, eq=False)
class DraftRow:
    """One request drafted this round (host only; mutated by its drafter while drafting)."""

    index: int  # its row in the proposal
    req: DraftSequence
    start: int  # first token the drafter's KV does not hold
    depth: int  # drafts it gets (<= γ)
    table: list[int]  # its block table in the drafter's pool
    survival: float = 1.0  # product of its drafts' confidences so far
    fed: int = 0  # drafts whose KV the drafter has written (fed back as inputs)


def check_draft_pool(book: DraftKVBook, kv_cache: PagedKVCache, owner: str) -> None:
    """Called by a drafter's constructor: ``book``'s allocator must hand out the blocks of
    ``kv_cache`` (same block size and count).

    Raises:
        ConfigError: they differ; the message names ``owner`` and both sizes.
    """
    alloc = book.allocator
    if (alloc.block_size, alloc.num_blocks) != (kv_cache.block_size, kv_cache.num_blocks):
        raise ConfigError(
            f"{owner} KV: the allocator has {alloc.num_blocks} blocks of {alloc.block_size}, "
            f"the cache {kv_cache.num_blocks} of {kv_cache.block_size}; build both from one size"
        )


def draft_depth(num_tokens: int, gamma: int, max_model_len: int) -> int:
    """Drafts a sequence of ``num_tokens`` tokens gets: at most ``gamma``, and every draft's
    position (``num_tokens .. num_tokens + depth - 1``) below ``max_model_len`` — the one
    depth rule of every model drafter (the scheduler cuts further for the request's own
    limit). Pure; may be ``<= 0`` (no drafts)."""
    return min(gamma, max_model_len - num_tokens)


def plan_rows(book: DraftKVBook, requests: Sequence[DraftSequence], gamma: int,
              max_model_len: int, kv_tokens: Callable[[int, int], int]) -> list[DraftRow]:
    """The requests that draft this round, each rolled back to the KV it still agrees with
    and its blocks reserved for ``kv_tokens(num_tokens, depth)`` tokens (what the drafter
    will write: a draft model feeds its drafts back, the DSpark backbone does not).
    Requests with no room for a draft, or whose blocks do not fit the pool this round, are
    left out (their valid KV is kept). Mutates ``book``."""
    rows: list[DraftRow] = []
    for index, req in enumerate(requests):
        sid, toks = req.request_id, req.all_token_ids
        n = len(toks)
        depth = draft_depth(n, gamma, max_model_len)
        if depth <= 0:
            continue
        start = min(book.reusable(sid, toks), n - 1)
        try:
            table = book.reserve(sid, kv_tokens(n, depth))
        except OutOfBlocksError:
            continue
        rows.append(DraftRow(index, req, start, depth, table))
    return rows


class OwnKVState:
    """The :class:`~deepinfer_kit.spec.protocols.StatefulDrafter` half every model drafter
    shares: its per-sequence KV lives in ``self.book`` (a :class:`DraftKVBook`), rolled back
    and released by content."""

    book: DraftKVBook

    def sync(self, running: Sequence[DraftSequence]) -> None:
        """See :meth:`StatefulDrafter.sync`: roll every running sequence back to the tokens
        it still agrees with, release the blocks of every sequence no longer running.
        O(running + held tokens)."""
        self.book.sync({r.request_id: r.all_token_ids for r in running})

    def check_idle(self) -> None:
        """See :meth:`StatefulDrafter.check_idle`."""
        self.book.check_idle()
