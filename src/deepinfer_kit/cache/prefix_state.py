"""PrefixState: what BlockKVCacheManager keeps on ``request.prefix_state``."""

from __future__ import annotations

from deepinfer_kit.request import Request

__all__ = ["PrefixState", "state_of"]


class PrefixState:
    """Per-request state of the manager (hot bookkeeping, not validated).

    keys: the index's per-block key memo for ``request.all_token_ids`` (hashed once).
    num_published: leading blocks of the table already published or taken from the cache.
    cow: some block in the table may be shared or published and written again (after a
        fork or a truncate), so writes must check for copy-on-write.
    hits, epoch: the last match_prefix result; still cached while no eviction happened.
    """

    __slots__ = ("keys", "num_published", "cow", "hits", "epoch")

    def __init__(self, keys: list[bytes], num_published: int, cow: bool) -> None:
        self.keys = keys
        self.num_published = num_published
        self.cow = cow
        self.hits: list[int] = []  # blocks of the last match_prefix ...
        self.epoch = -1  # ... valid while the manager's eviction count is this


def state_of(request: Request) -> PrefixState:
    """``request.prefix_state``, created (replacing anything else) when it is not ours."""
    st = request.prefix_state
    if type(st) is not PrefixState:
        st = PrefixState([], 0, False)
        request.prefix_state = st
    return st
