"""ExactLRUPrefixCache: a naive, obviously-correct model of the KV cache manager's block
accounting and exact-LRU prefix caching; the spec the tests and the benchmark check
:class:`BlockKVCacheManager` against."""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deepinfer_kit.cache.protocols import EvictionPolicy

__all__ = ["ExactLRUPrefixCache", "StampLRU"]


class StampLRU:
    """Exact LRU over last-use stamps and a lazy heap: an :class:`EvictionPolicy` with
    O(log n) calls (the model's default order; ``testing.eviction.LRUModel`` is the O(n)
    list version of the same order)."""

    def __init__(self) -> None:
        self._stamp: dict[int, int] = {}
        self._heap: list[tuple[int, int]] = []
        self._clock = 0

    def __len__(self) -> int:
        return len(self._stamp)

    def push(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self._clock += 1
            self._stamp[b] = self._clock
            heapq.heappush(self._heap, (self._clock, b))

    def discard(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self._stamp.pop(b, None)

    def touch(self, blocks: Sequence[int]) -> None:
        self.push([b for b in blocks if b in self._stamp])

    def pop(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n and self._stamp:
            stamp, b = heapq.heappop(self._heap)
            if self._stamp.get(b) == stamp:
                del self._stamp[b]
                out.append(b)
        return out


class ExactLRUPrefixCache:
    """Block accounting and prefix caching, modelled with plain dicts.

    It tracks no physical ids: every held block is a fresh virtual id with a reference
    count; a published block is the one virtual id of a content identity (the exact
    tuple of all tokens up to the block's end, plus the context, interned as an int).
    Evictable blocks are kept in an eviction policy, fed the calls a prefix index makes
    to its own (``push`` when a cached block's last holder lets go, ``discard`` when one
    is taken again, ``touch`` on a match's hits, tail first, ``pop`` to evict): exact LRU
    (:class:`StampLRU`) unless ``policy`` names another order. The operations mirror
    :class:`KVCacheManager` with the request's fields passed explicitly, so a test can
    drive the model and a manager with the same calls and compare hit lengths, failures,
    copies and block counts.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block ``P``.
        caching: False turns prefix caching off (nothing is published or matched).
        policy: the eviction order (a fresh :class:`EvictionPolicy` over virtual ids);
            exact LRU by default.
    """

    def __init__(self, num_blocks: int, block_size: int, caching: bool = True,
                 policy: EvictionPolicy | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self.tables: dict[str, list[int]] = {}  # request id -> virtual block ids
        self._published: dict[str, int] = {}  # request id -> leading blocks published
        self._ids: dict[tuple[object, tuple[int, ...]], int] = {}  # (prev, block) -> cid
        self._vid_of_cid: dict[int, int] = {}
        self._cid_of_vid: dict[int, int] = {}
        self._ref: dict[int, int] = {}  # every held block (cached unreferenced ones: 0)
        self._policy: EvictionPolicy = policy if policy is not None else StampLRU()
        self._evictable: set[int] = set()
        self._next_vid = 0

    @property
    def num_free(self) -> int:
        """Blocks neither referenced nor cached."""
        return self.num_blocks - len(self._ref)

    @property
    def num_evictable(self) -> int:
        """Cached blocks with no reference."""
        return len(self._evictable)

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


    def match_prefix(self, tokens: Sequence[int], context: Hashable = None) -> int:
        """Cached tokens of ``tokens`` (at most ``len - 1``); refreshes the hits, head
        last used."""
        if not self.caching:
            return 0
        hits = self._hits(tokens, context, (len(tokens) - 1) // self.block_size)
        touched = [vid for vid in reversed(hits) if vid in self._evictable]
        if touched:
            self._policy.touch(touched)
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
            if v in self._evictable:
                self._evictable.discard(v)
                self._policy.discard([v])
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
        vid = self._policy.pop(1)[0]
        self._evictable.discard(vid)
        del self._ref[vid]
        del self._vid_of_cid[self._cid_of_vid.pop(vid)]

    def _release(self, vid: int) -> None:
        self._ref[vid] -= 1
        if self._ref[vid] == 0:
            if vid in self._cid_of_vid:
                self._evictable.add(vid)
                self._policy.push([vid])
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
