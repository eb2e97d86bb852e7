"""PrefixRouterView: what a router knows of each engine's cached prefixes, from their KV
events — device, host and disk alike — to send a prompt where most of it is cached."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

from deepinfer_kit.cache.hashing import BlockHasher
from deepinfer_kit.cache.tiers.manager import chain_keys
from deepinfer_kit.cache.tiers.records import MEDIA, KVEvent

__all__ = ["PrefixRouterView"]


class PrefixRouterView:
    """Per engine, the block keys each medium holds, kept from the engines' KV events
    (``Engine.cache.take_kv_events()``), and the routing question it answers: which engine
    holds the longest prefix of a prompt in any medium.

    The engines must share the tiers' ``hash_key`` (keys are keyed BLAKE2b: a view computes
    a prompt's keys with the same key) and block size. A prefix held on an engine's disk
    counts as a hit there (loading it costs a read, not a prefill), which a router that
    sees only device blocks misses.

    Args:
        hash_key: the engines' ``TierConfig.hash_key``.
        block_size: the engines' block size.
    """

    def __init__(self, hash_key: bytes, block_size: int) -> None:
        self._hasher = BlockHasher(hash_key)
        self._P = block_size
        self._held: dict[Hashable, dict[str, set[bytes]]] = {}

    def apply(self, engine: Hashable, events: Iterable[KVEvent]) -> None:
        """Fold ``engine``'s events (oldest first) into the view. O(keys)."""
        media = self._held.setdefault(engine, {m: set() for m in MEDIA})
        for ev in events:
            held = media[ev.medium]
            if ev.kind == "stored":
                held.update(ev.keys)
            elif ev.kind == "removed":
                held.difference_update(ev.keys)
            else:
                held.clear()

    def apply_feed(self, engine: Hashable, feed: Mapping[str, Any]) -> int:
        """Fold a server's ``GET /v1/kv_events?after=N`` answer into ``engine``'s view and
        return the cursor for the next request (its ``last``). An answer that says events
        were ``lost`` (read too rarely) first forgets what the view held of ``engine``: it
        rebuilds from what follows (undercounting, never routing to what is gone)."""
        if feed.get("lost"):
            self._held[engine] = {m: set() for m in MEDIA}
        self.apply(engine, [KVEvent(e["kind"], e["medium"], tuple(bytes.fromhex(k) for k in e["keys"]))
                            for e in feed.get("events", [])])
        return int(feed.get("last", 0))

    def matched_blocks(self, engine: Hashable, tokens: Sequence[int], context: Hashable = None) -> int:
        """Leading full blocks of ``tokens`` that ``engine`` holds in some medium (the last
        token never counts, as an engine always computes it). O(blocks)."""
        media = self._held.get(engine)
        if media is None:
            return 0
        keys = chain_keys(self._hasher, tokens, context, self._P, (len(tokens) - 1) // self._P)
        n = 0
        for key in keys:
            if not any(key in held for held in media.values()):
                break
            n += 1
        return n

    def best(self, tokens: Sequence[int], context: Hashable = None) -> tuple[Hashable | None, int]:
        """The engine holding the most leading blocks of ``tokens`` (ties: the first
        applied), and how many; ``(None, 0)`` when no engine holds any."""
        best: tuple[Hashable | None, int] = (None, 0)
        for engine in self._held:
            n = self.matched_blocks(engine, tokens, context)
            if n > best[1]:
                best = (engine, n)
        return best
