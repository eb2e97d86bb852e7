"""Cache specs per layer and the groups of layers that share one: what each layer keeps of a
sequence's KV, and how many blocks that takes.

A model's layers fall into groups by spec (``KVLayout.from_windows``): group 0 holds the
full-attention layers (every token's K/V for the whole sequence; the group may have no
layers, as in a model whose every layer slides), and one group per distinct sliding window
holds the layers that attend to the last ``window`` tokens only. Every group addresses a
token by the same logical block ``t // P``; the full group's block table names its blocks,
and a sliding group maps each full-group block it still needs to one of its own
(``cache.window_map``), so it holds at most :meth:`SlidingWindowSpec.max_blocks` blocks a
sequence however long the sequence grows.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from deepinfer_kit.errors import ConfigError

__all__ = ["FullAttentionSpec", "SlidingWindowSpec", "CacheSpec", "KVLayout"]


@attrs.frozen(slots=True)
class FullAttentionSpec:
    """Every token's K/V, for the whole sequence."""

    def first_needed_token(self, start: int) -> int:
        """The first position a step whose new tokens start at ``start`` reads: 0."""
        return 0


@attrs.frozen(slots=True)
class SlidingWindowSpec:
    """The last ``window`` tokens' K/V (the token itself included), plus ``backtrack``
    tokens of room below the window so a speculative rollback of up to ``backtrack``
    tokens finds its window still cached.

    Raises:
        ConfigError: ``window < 1`` or ``backtrack < 0``.
    """

    window: int
    backtrack: int = 0

    def __attrs_post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ConfigError(f"sliding window must be an int >= 1, got {self.window!r}")
        if isinstance(self.backtrack, bool) or not isinstance(self.backtrack, int) or self.backtrack < 0:
            raise ConfigError(f"backtrack must be an int >= 0, got {self.backtrack!r}")

    def first_needed_token(self, start: int) -> int:
        """The first position a step whose new tokens start at ``start`` (or a later step,
        after a rollback of at most ``backtrack`` tokens) reads: the token at ``start``
        attends to ``start - window + 1 .. start``."""
        return max(0, start - self.window + 1 - self.backtrack)

    def max_blocks(self, block_size: int, chunk: int = 1) -> int:
        """Blocks one sequence holds at most while computing ``chunk`` new tokens a step:
        ``ceil((window - 1 + backtrack + chunk) / P) + 1`` (the window need not start on a
        block boundary)."""
        return -(-(self.window - 1 + self.backtrack + chunk) // block_size) + 1


CacheSpec = FullAttentionSpec | SlidingWindowSpec


@attrs.frozen(slots=True)
class KVLayout:
    """Which layers share a cache spec.

    Attributes:
        specs: one spec per group; ``specs[0]`` is always :class:`FullAttentionSpec`.
        group_of_layer: the group of each model layer.
    """

    specs: tuple[CacheSpec, ...]
    group_of_layer: tuple[int, ...]

    @classmethod
    def from_windows(cls, windows: Sequence[int | None], backtrack: int = 0) -> KVLayout:
        """Group ``L`` layers by their sliding window (``None``: full attention).

        Sliding groups are numbered from 1 in order of their windows, smallest first.

        Raises:
            ConfigError: a window that is not an int >= 1, or a negative ``backtrack``.
        """
        distinct = sorted({w for w in windows if w is not None})
        specs: list[CacheSpec] = [FullAttentionSpec()]
        specs += [SlidingWindowSpec(w, backtrack) for w in distinct]
        group = {w: i + 1 for i, w in enumerate(distinct)}
        return cls(tuple(specs), tuple(0 if w is None else group[w] for w in windows))

    @property
    def num_groups(self) -> int:
        """Groups, the full group included even when it has no layers."""
        return len(self.specs)

    def layers_of(self, group: int) -> list[int]:
        """The model layers of ``group``, in order."""
        return [i for i, g in enumerate(self.group_of_layer) if g == group]

    def sliding(self) -> list[tuple[int, SlidingWindowSpec]]:
        """``(group, spec)`` of every sliding group."""
        return [(g, s) for g, s in enumerate(self.specs) if isinstance(s, SlidingWindowSpec)]

    @property
    def replay_bound(self) -> int:
        """Tokens before a prefix hit's end that a recompute must start from for the
        sliding layers' K/V of the window before it to come out exact, when those windows
        are gone but the full layers' K/V is cached: each sliding layer moves the first
        exact position ``window - 1`` tokens on (its keys before the recompute are
        missing), the full layers do not (they read the cached K/V), and the window itself
        must be exact: ``sum (window - 1)`` over the sliding layers plus the largest
        window. 0 without sliding layers."""
        sliding = [(s.window, len(self.layers_of(g))) for g, s in self.sliding()]
        if not sliding:
            return 0
        return sum((w - 1) * n for w, n in sliding) + max(w for w, _ in sliding)

    def sliding_pool_blocks(self, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                            idle_windows: int = 3) -> list[int]:
        """Blocks for each sliding group's pool (in group order): every running sequence's
        window at once (:meth:`SlidingWindowSpec.max_blocks` of a one-token step), the
        blocks of one round's new tokens beyond that, and ``idle_windows`` times the running
        sequences' windows for windows kept idle for prefix hits (a hit needs its window:
        3 kept the hit rate of an all-full cache in the same memory on the long-prefix
        multi-turn workload of ``benchmarks/bench_hybrid_kv.py``; 1 lost 0.13 of it)."""
        sizes = []
        for _, spec in self.sliding():
            windows = max_num_seqs * spec.max_blocks(block_size)
            sizes.append(windows + -(-max_num_batched_tokens // block_size) + 1 + idle_windows * windows)
        return sizes
