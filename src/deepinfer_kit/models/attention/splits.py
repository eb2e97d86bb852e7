"""How many context splits (split-K) the Triton paged attention uses for a batch, and every
count it can pick for an engine's limits (what warm-up compiles).

Triton-free, so the engine's warm-up can enumerate the counts on any machine.
"""

from __future__ import annotations

import bisect

import torch

from deepinfer_kit.models.records import AttentionMetadata

__all__ = ["choose_num_splits", "num_splits_for", "split_target", "num_splits_witnesses",
           "decode_context_buckets", "INVARIANT_SPLIT_KEYS", "invariant_num_splits",
           "invariant_split_programs"]

MAX_SPLITS = 64

INVARIANT_SPLIT_KEYS = 256
"""Keys per split of the batch-invariant attention (``triton_ops.paged_attention_invariant``):
a row's splits start at multiples of this count whatever the batch, so its partial sums
and their merge are the same in every batch."""


def num_splits_for(max_query_len: int, num_requests: int, max_seq_len: int, num_kv_heads: int,
                   target_programs: int) -> int:
    """The split count of a batch described by its sizes (1 for prefill batches).

    Splits only when the query tiles alone give fewer than ``target_programs`` programs and
    each split still covers at least 256 keys. Non-decreasing in ``max_seq_len`` (what
    :func:`num_splits_witnesses` relies on).
    """
    if max_query_len > 8:
        return 1
    programs = num_requests * num_kv_heads
    by_len = max(1, max_seq_len // 256)
    return max(1, min(by_len, -(-target_programs // max(programs, 1)), MAX_SPLITS))


def choose_num_splits(meta: AttentionMetadata, num_kv_heads: int, target_programs: int) -> int:
    """:func:`num_splits_for` of ``meta``'s host sizes; called by the Triton paged attention
    once per launch when the caller does not force a count."""
    return num_splits_for(meta.max_query_len, meta.num_requests, meta.max_seq_len, num_kv_heads,
                          target_programs)


def split_target(device: torch.device) -> int:
    """Programs the attention grid should reach on ``device``: twice the SMs of a CUDA
    device, 1 elsewhere (so the interpreter never splits)."""
    if device.type != "cuda":
        return 1
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def num_splits_witnesses(max_requests: int, max_model_len: int, num_kv_heads: int,
                         target_programs: int) -> dict[int, tuple[int, int]]:
    """Every split count a decode round (query length 1) can get, each with one
    ``(num_requests, max_seq_len)`` that gets it, for up to ``max_requests`` requests of
    contexts up to ``max_model_len``.

    Called by the engine's warm-up, which runs one dummy round per witness so that no
    split count compiles inside a step. Asks :func:`num_splits_for` itself (no copy of its
    rule): for each request count it bisects the context lengths at which the count
    changes, O(max_requests * counts * log(max_model_len)).
    """
    found: dict[int, tuple[int, int]] = {}
    for requests in range(1, max_requests + 1):
        def count(seq_len: int, r: int = requests) -> int:
            return num_splits_for(1, r, seq_len, num_kv_heads, target_programs)

        seq_len = 1
        while seq_len <= max_model_len:
            value = count(seq_len)
            found.setdefault(value, (requests, seq_len))
            # the first length past seq_len whose count differs
            lengths = range(seq_len, max_model_len + 1)
            seq_len += bisect.bisect_right(lengths, value, key=count)
    return found


def decode_context_buckets(sizes: list[int], max_model_len: int, num_kv_heads: int,
                           target_programs: int) -> dict[int, list[int]]:
    """Per decode batch size, the context bounds at which a captured decode graph is kept:
    a round of ``size`` requests whose longest context is ``m`` replays the graph of the
    first bound ``>= m``, captured with that bound as its host length, so its split count
    is :func:`num_splits_for` of the bound rather than of ``max_model_len``.

    Candidate bounds double from 256 keys (the split rule's unit) up to ``max_model_len``
    (always the last bound); of consecutive bounds with the same split count only the
    largest is kept, so every bound of a size has its own count. A round therefore runs at
    most twice the split count its own length would choose (one doubling), never fewer.
    Called once by the engine's builder; host only.

    Returns:
        ``{size: [bound, ...]}`` ascending, each list ending at ``max_model_len``.
    """
    candidates = [c for c in (256 << k for k in range(32)) if c < max_model_len]
    candidates.append(max_model_len)
    buckets: dict[int, list[int]] = {}
    for size in sizes:
        kept: list[int] = []
        counts: list[int] = []
        for bound in candidates:
            count = num_splits_for(1, size, bound, num_kv_heads, target_programs)
            if counts and counts[-1] == count:
                kept[-1] = bound
            else:
                kept.append(bound)
                counts.append(count)
        buckets[size] = kept
    return buckets


def invariant_num_splits(max_seq_len: int) -> int:
    """Split programs per query tile of the batch-invariant attention when it splits across
    programs: ``ceil(max_seq_len / INVARIANT_SPLIT_KEYS)`` (at least 1), one per
    :data:`INVARIANT_SPLIT_KEYS` keys of the longest context; a shorter row's trailing
    splits are empty and merge as exact no-ops. The count is a runtime argument of the
    kernels (never a ``tl.constexpr``), so no count needs its own compilation or warm-up.
    Called by ``paged_attention_invariant`` once per launch; host only, pure."""
    return max(1, -(-max_seq_len // INVARIANT_SPLIT_KEYS))


def invariant_split_programs(max_query_len: int, num_requests: int, max_seq_len: int,
                             num_kv_heads: int, target_programs: int) -> bool:
    """Whether the batch-invariant attention spreads a row's splits over programs (partials
    merged by a second kernel) rather than merging them in the query tile's own program:
    exactly when :func:`num_splits_for` would split (short queries, few programs, at least
    two splits' worth of keys), so every round of :func:`num_splits_witnesses` with a count
    above 1 runs (and warms) the split path. Both paths give bitwise the same output; the
    choice only trades parallelism for partial buffers. Called by
    ``paged_attention_invariant`` once per launch unless its caller forces a path; host
    only, pure."""
    return num_splits_for(max_query_len, num_requests, max_seq_len, num_kv_heads, target_programs) > 1
