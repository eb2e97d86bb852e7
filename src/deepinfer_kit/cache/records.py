"""Configs and records of the cache package."""

from __future__ import annotations

from typing import NamedTuple

import attrs

from deepinfer_kit._validators import int_at_least

__all__ = ["CacheConfig", "PrefixCacheStats", "SlotGrant", "WindowHitStats"]


@attrs.frozen(slots=True)
class CacheConfig:
    """Shape of the block pool.

    Attributes:
        block_size: tokens per block (``P``).
        num_blocks: physical blocks in the pool.
        enable_prefix_caching: publish full blocks for reuse by later requests.
    """

    block_size: int = attrs.field(default=16, validator=int_at_least(1))
    num_blocks: int = attrs.field(default=1024, validator=int_at_least(1))
    enable_prefix_caching: bool = True


@attrs.define(slots=True)
class PrefixCacheStats:
    """Counters of a prefix index, cumulative since construction (or the last reset).

    Attributes:
        queries: ``match`` calls.
        query_blocks: full blocks asked for across all queries.
        hit_blocks: full blocks found.
        inserted_blocks: blocks newly published.
        evicted_blocks: blocks whose identity was evicted.
    """

    queries: int = 0
    query_blocks: int = 0
    hit_blocks: int = 0
    inserted_blocks: int = 0
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of queried full blocks that hit (0.0 when nothing was queried)."""
        return self.hit_blocks / self.query_blocks if self.query_blocks else 0.0


class SlotGrant(NamedTuple):
    """What one :func:`~deepinfer_kit.cache.slots.allocate_slots` call gave a request.

    A named tuple (immutable; built once per scheduled request per step, so it is kept
    cheaper to make than an attrs record).

    Attributes:
        num_cached_tokens: tokens taken from the prefix cache by this call (0 unless the
            request held no blocks and its prefix was cached).
        num_computed_tokens: where this step's computation starts; the request's
            ``num_computed_tokens`` is set to it.
        num_new_tokens: tokens to compute this step, from ``num_computed_tokens`` on.
        copies: ``(src, dst)`` block copies to perform on the device before the forward.
    """

    num_cached_tokens: int
    num_computed_tokens: int
    num_new_tokens: int
    copies: list[tuple[int, int]]


@attrs.define(slots=True)
class WindowHitStats:
    """What the windows cost the prefix cache (live counters of :meth:`match_prefix`).

    Attributes:
        queries: matches with a full-group hit.
        full_hit_tokens: tokens the full group's index matched.
        kept_tokens: tokens kept after the window check (the rest is recomputed).
        replay_tokens: what a bounded replay would recompute instead of the tokens lost,
            ``sum min(lost, KVLayout.replay_bound)`` (priced whether or not replays run).
        replays: hits served whole by a bounded replay (:meth:`replay_start`).
        replayed_tokens: tokens those replays recompute.
    """

    queries: int = 0
    full_hit_tokens: int = 0
    kept_tokens: int = 0
    replay_tokens: int = 0
    replays: int = 0
    replayed_tokens: int = 0
