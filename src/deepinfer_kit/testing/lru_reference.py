"""ExactLRUPrefixCache: a naive, obviously-correct model of the KV cache manager's block
accounting and exact-LRU prefix caching; the spec the tests and the benchmark check
:class:`BlockKVCacheManager` against."""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence

__all__ = ["ExactLRUPrefixCache"]


class ExactLRUPrefixCache:
    """Block accounting and prefix caching, modelled with plain dicts.

    It tracks no physical ids: every held block is a fresh virtual id with a reference
    count; a published block is the one virtual id of a content identity (the exact
    tuple of all tokens up to the block's end, plus the context, interned as an int).
    Evictable blocks carry a last-use stamp; eviction pops the smallest stamp. The
    operations mirror :class:`KVCacheManager` with the request's fields passed
    explicitly, so a test can drive the model and a manager with the same calls and
    compare hit lengths, failures, copies and block counts.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block ``P``.
        caching: False turns prefix caching off (nothing is published or matched).
    """

    def __init__(self, num_blocks: int, block_size: int, caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self.tables: dict[str, list[int]] = {}  # request id -> virtual block ids
        self._published: dict[str, int] = {}  # request id -> leading blocks published
        self._ids: dict[tuple[object, tuple[int, ...]], int] = {}  # (prev, block) -> cid
        self._vid_of_cid: dict[int, int] = {}
        self._cid_of_vid: dict[int, int] = {}
        self._ref: dict[int, int] = {}  # every held block (cached unreferenced ones: 0)
        self._stamp: dict[int, int] = {}  # evictable blocks -> last use
        self._heap: list[tuple[int, int]] = []
        self._clock = 0
        self._next_vid = 0

    @property
    def num_free(self) -> int:
        """Blocks neither referenced nor cached."""
        return self.num_blocks - len(self._ref)

    @property
    def num_evictable(self) -> int:
        """Cached blocks with no reference."""
        return len(self._stamp)

    def _chain(self, tokens: Sequence[int], context: Hashable, n: int, create: bool) -> list[int]:
        P = self.block_size
        out: list[int] = []
        prev: object = ("root", context)
        for i in range(n):
            key = (prev, tuple(tokens[i * P : (i + 1) * P]))
            cid = self._ids.get(key)
            if cid is None:
                if not create:
                    break
                cid = self._ids[key] = len(self._ids)
            out.append(cid)
            prev = cid
        return out

    def _hits(self, tokens: Sequence[int], context: Hashable, n: int) -> list[int]:
        hits = []
        for cid in self._chain(tokens, context, n, create=False):
            vid = self._vid_of_cid.get(cid)
            if vid is None:
                break
            hits.append(vid)
        return hits

    def _make_evictable(self, vid: int) -> None:
        self._clock += 1
        self._stamp[vid] = self._clock
        heapq.heappush(self._heap, (self._clock, vid))

    def match_prefix(self, tokens: Sequence[int], context: Hashable = None) -> int:
        """Cached tokens of ``tokens`` (at most ``len - 1``); refreshes the hits, head
        last used."""
        if not self.caching:
            return 0
        hits = self._hits(tokens, context, (len(tokens) - 1) // self.block_size)
        for vid in reversed(hits):
            if vid in self._stamp:
                self._make_evictable(vid)
        return len(hits) * self.block_size

    def allocate(
        self, rid: str, tokens: Sequence[int], context: Hashable, num_computed: int,
        n: int, num_cached: int = 0,
    ) -> int | None:
        """Like ``KVCacheManager.allocate``; returns the number of block copies, or
        ``None`` (changing nothing) when the pool cannot supply the blocks."""
        P = self.block_size
        table = self.tables.setdefault(rid, [])
        cached: list[int] = []
        if table:
            start = num_computed
        else:
            start = num_cached
            if num_cached:
                cached = self._hits(tokens, context, num_cached // P)
                if len(cached) * P < num_cached:
                    raise ValueError("stale num_cached")
        end_block = -(-(start + n) // P)
        num_new = max(0, end_block - len(table) - len(cached))
        cow = [
            j for j in range(start // P, min(len(table), end_block))
            if n and (self._ref[table[j]] > 1 or table[j] in self._cid_of_vid)
        ]
        need = num_new + len(cow)
        taken = sum(1 for v in cached if self._ref[v] == 0)
        if need > self.num_free + self.num_evictable - taken:
            return None
        for v in cached:
            self._ref[v] += 1
            self._stamp.pop(v, None)
        table.extend(cached)
        if cached:
            self._published[rid] = len(cached)
        while self.num_free < need:
            self._evict_one()
        for _ in range(num_new):
            table.append(self._new_vid())
        for j in cow:
            old = table[j]
            table[j] = self._new_vid()
            self._release(old)
            self._published[rid] = min(self._published.get(rid, 0), j)
        return len(cow)

    def _new_vid(self) -> int:
        self._next_vid += 1
        self._ref[self._next_vid] = 1
        return self._next_vid

    def _evict_one(self) -> None:
        while True:
            stamp, vid = heapq.heappop(self._heap)
            if self._stamp.get(vid) == stamp:
                break
        del self._stamp[vid]
        del self._ref[vid]
        del self._vid_of_cid[self._cid_of_vid.pop(vid)]

    def _release(self, vid: int) -> None:
        self._ref[vid] -= 1
        if self._ref[vid] == 0:
            if vid in self._cid_of_vid:
                self._make_evictable(vid)
            else:
                del self._ref[vid]

    def publish(self, rid: str, tokens: Sequence[int], context: Hashable, num_tokens: int) -> None:
        """Like ``KVCacheManager.cache_full_blocks``."""
        if not self.caching:
            return
        table = self.tables.get(rid, [])
        n_full = min(num_tokens // self.block_size, len(table))
        done = self._published.get(rid, 0)
        if n_full <= done:
            return
        cids = self._chain(tokens, context, n_full, create=True)
        for i in range(done, n_full):
            vid = table[i]
            if cids[i] not in self._vid_of_cid and vid not in self._cid_of_vid:
                self._vid_of_cid[cids[i]] = vid
                self._cid_of_vid[vid] = cids[i]
        self._published[rid] = n_full

    def fork(self, parent: str, child: str) -> None:
        """Like ``KVCacheManager.fork``."""
        table = self.tables.get(parent, [])
        for v in table:
            self._ref[v] += 1
        self.tables[child] = list(table)
        self._published[child] = self._published.get(parent, 0)

    def truncate(self, rid: str, num_tokens: int) -> None:
        """Like ``KVCacheManager.truncate``."""
        table = self.tables.get(rid, [])
        keep = -(-num_tokens // self.block_size)
        for v in reversed(table[keep:]):
            self._release(v)
        del table[keep:]
        self._published[rid] = min(self._published.get(rid, 0), keep)

    def free(self, rid: str) -> None:
        """Like ``KVCacheManager.free``."""
        for v in reversed(self.tables.pop(rid, [])):
            self._release(v)
        self._published.pop(rid, None)
