"""What the model-running drafters share: the row of one request drafted in a round, and
the check that a drafter's KV pool and its book describe the same blocks."""

from __future__ import annotations

import attrs

from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.spec.protocols import DraftSequence
from deepinfer_kit.spec.draft_kv import DraftKVBook

__all__ = ["DraftRow", "check_draft_pool"]


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
