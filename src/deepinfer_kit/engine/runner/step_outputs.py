"""The copy back of a step's sampled tokens and logprobs, and the per-chunk logprob maps."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from deepinfer_kit._staging import host_to_device
from deepinfer_kit.engine.runner.token_slots import CONTINUED_UNSAMPLED, NEVER_SAMPLED, UNSAMPLED
from deepinfer_kit.outputs import Logprob
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sample.records import SampleResult, SamplingBatch
from deepinfer_kit.sched.records import ScheduledChunk, SchedulePlan

__all__ = [
    "HostCopy", "host_rows", "HostLogprobs", "asked_top", "chunk_results", "chunk_results_general", "copy_back", "finite_rows",
    "logprob_maps", "to_host",
]

HostLogprobs = tuple[list[float], list[int], list[list[int]], list[list[float]]]
"""Per row: the chosen token's logprob and rank, the top ids and their logprobs."""


def asked_top(
    top_ids: torch.Tensor, top_lp: torch.Tensor, wants: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The first ``wants[r]`` entries of each row of ``top_ids`` / ``top_lp`` (``[N, K]``,
    ``wants[r] <= K``), flattened row after row, and each row's start in them (``N + 1``
    offsets). When every row wants all ``K`` this is a reshape; otherwise one gather on
    the device, so a whole-vocabulary row (``K = V``) does not make the other rows of its
    batch copy ``V`` entries back to the host. The gather's positions are computed on the
    host (their count is known there) and staged like every input, so it never makes the
    host wait for the device (a boolean mask would: its result size lives on the device)."""
    n, k = top_ids.shape
    counts = [min(w, k) for w in wants]
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    if all(c == k for c in counts):
        return top_ids.reshape(-1), top_lp.reshape(-1), starts
    per_row = torch.tensor(counts, dtype=torch.int64)
    total = starts[-1]
    # position j of row r's prefix is r * K + j: each row's base, plus the rank within its run
    rows = torch.repeat_interleave(torch.arange(n, dtype=torch.int64), per_row)
    begins = torch.tensor(starts[:-1], dtype=torch.int64)
    where = rows * k + (torch.arange(total, dtype=torch.int64) - begins[rows])
    index = host_to_device(where, top_ids.device)
    return top_ids.reshape(-1).index_select(0, index), top_lp.reshape(-1).index_select(0, index), starts


def finite_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(finite, clean)`` of ``[N, V]`` logits: ``finite`` ``[N]`` bool, True where the
    row holds no NaN and no infinity; ``clean`` ``[N, V]`` float32, the logits with every
    other row zeroed (what the sampler may read). Both on the logits' device, no sync.

    A row's largest and smallest values are finite exactly when all of it is (a NaN
    propagates through both reductions): two row reductions instead of an elementwise
    test of all ``N * V`` values and its reduction. A row times 0 or 1, then its NaNs
    and infinities set to 0, is that row zeroed or kept bit for bit: two plain
    elementwise passes, no boolean ``[N, V]`` mask."""
    finite = logits.amax(dim=-1).isfinite() & logits.amin(dim=-1).isfinite()
    kept = logits * finite[:, None].to(logits.dtype)
    return finite, kept.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0).to(torch.float32)


@attrs.define(slots=True, eq=False)
class HostCopy:
    """The copy back of one step's sampled rows, queued by :func:`copy_back` and read by
    :meth:`read` (``N`` sampling rows; ``A`` top alternatives asked for, all rows together).

    Attributes:
        ints: ``[N]`` int64 tokens (``-1`` / ``-2`` sentinels), or ``[2N + A]`` with
            each row's rank and its top ids after them; on the host (pinned on CUDA).
        floats: ``[N + A]`` float32, each row's logprob then the top logprobs, on the
            host; ``None`` when no row asked for logprobs.
        starts: ``[N + 1]`` offsets of each row's top alternatives within the ``A``.
        event: recorded on the device's stream after the copies (CUDA), or ``None``
            (elsewhere the copies are done when :func:`copy_back` returns).
    """

    ints: torch.Tensor
    floats: torch.Tensor | None = None
    starts: list[int] = attrs.field(factory=list)
    event: torch.cuda.Event | None = None

    def read(self) -> tuple[list[int], HostLogprobs | None]:
        """Wait for the copies (the event, on CUDA), then ``(tokens, logprobs)`` as
        :func:`to_host` returns them. Blocks the calling thread only; mutates nothing."""
        if self.event is not None:
            self.event.synchronize()
        ints: list[int] = self.ints.tolist()
        if self.floats is None:
            return ints, None
        floats: list[float] = self.floats.tolist()
        n, starts = len(self.starts) - 1, self.starts
        tops = [ints[2 * n + starts[r] : 2 * n + starts[r + 1]] for r in range(n)]
        top_floats = [floats[n + starts[r] : n + starts[r + 1]] for r in range(n)]
        return ints[:n], (floats[:n], ints[n : 2 * n], tops, top_floats)


def copy_back(
    flagged: torch.Tensor, sampled: SampleResult, params: Sequence[SamplingParams] | None = None
) -> HostCopy:
    """Queue the step's one copy back and return without waiting for it: the tokens
    (``flagged``, ``[N]`` int64, ``-1`` for a non-finite row) and, when a row asked for
    logprobs, their ranks and top ids in the same int64 copy, the float logprobs in one
    more. ``params[r]``: row ``r``'s parameters; only the top alternatives its
    ``logprobs`` asks for come back (``None``: all ``K`` of every row).

    On CUDA each copy goes into fresh pinned memory with ``non_blocking=True`` on the
    current stream and an event is recorded after them (the host is not blocked; the
    gather of :func:`asked_top` is staged too); elsewhere the returned tensors are new
    host tensors. Mutates nothing."""
    n = flagged.shape[0]
    if sampled.logprobs is None or sampled.ranks is None:
        ints, floats, starts = flagged, None, [0] * (n + 1)
    else:
        top_ids = sampled.top_token_ids
        top_lp = sampled.top_logprobs
        if top_ids is not None and top_lp is not None:
            k = top_ids.shape[1]
            wants = [p.logprobs or 0 for p in params] if params is not None else [k] * n
            flat_ids, flat_lp, starts = asked_top(top_ids, top_lp, wants)
            extra_ints, extra_floats = [flat_ids], [flat_lp]
        else:
            extra_ints, extra_floats, starts = [], [], [0] * (n + 1)
        ints = torch.cat([flagged, sampled.ranks, *extra_ints])
        floats = torch.cat([sampled.logprobs, *extra_floats])
    if flagged.device.type != "cuda":
        return HostCopy(ints.clone() if ints is flagged else ints, floats, starts)
    host_ints = _pinned_copy(ints)
    host_floats = _pinned_copy(floats) if floats is not None else None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    return HostCopy(host_ints, host_floats, starts, event)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A pinned host tensor that ``t`` (CUDA) is copied into, queued without blocking."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def to_host(
    flagged: torch.Tensor, sampled: SampleResult, params: Sequence[SamplingParams] | None = None
) -> tuple[list[int], HostLogprobs | None]:
    """The step's one copy back, waited for: :func:`copy_back` then :meth:`HostCopy.read`
    — the tokens (``-1`` for a non-finite row) and, when a row asked for logprobs, the
    chosen logprobs, ranks and asked top alternatives per row."""
    return copy_back(flagged, sampled, params).read()


def logprob_maps(
    chosen: list[int], host: HostLogprobs, row_counts: Sequence[int], sampling: SamplingBatch
) -> list[list[dict[int, Logprob]]]:
    """Per chunk, per drawn token: the chosen token's Logprob plus the asked top alternatives."""
    chosen_lp, ranks, top_ids, top_lp = host
    maps: list[list[dict[int, Logprob]]] = []
    row = 0
    for count in row_counts:
        per_chunk: list[dict[int, Logprob]] = []
        for r in range(row, row + count):
            want = sampling.params[r].logprobs
            entry: dict[int, Logprob] = {}
            if want is not None:
                for rank, (tok, lp) in enumerate(zip(top_ids[r][:want], top_lp[r][:want]), 1):
                    entry[tok] = Logprob(logprob=lp, rank=rank)
                entry[chosen[r]] = Logprob(logprob=chosen_lp[r], rank=ranks[r])
            per_chunk.append(entry)
        maps.append(per_chunk)
        row += count
    return maps


def chunk_results(
    plan: SchedulePlan, tokens: list[int], row_counts: Sequence[int], kept: dict[int, int],
    positions: Sequence[int], logprobs: list[list[dict[int, Logprob]]] | None,
) -> tuple[list[list[int]], list[str | None], dict[str, int]]:
    """A step's host tokens (``[N]``, one per sampling row, with the token slots'
    sentinels) cut into per-chunk lists: ``(token_ids, errors, last)``.

    A chunk takes its ``row_counts[i]`` rows, or the ``kept[i]`` tokens a verified chunk
    emitted; a row marked :data:`CONTINUED_UNSAMPLED` fails its chunk (it continued from a
    token never sampled), one marked :data:`UNSAMPLED` too (non-finite logits at that
    output position, from ``positions``). ``last`` maps each sequence whose penalties or
    ``min_tokens`` read its history to the token it sampled last (the next step's
    placeholder history). Trims a verified chunk's ``logprobs`` to its tokens (mutated in
    place). The plan's decode rows (first in the batch, one row each, no history) are
    read as columns. Host only; O(N)."""
    chunks = plan.chunks
    rows = len(plan.decodes)
    if not kept and len(tokens) == rows + len(chunks) == row_counts.count(1) and (not tokens or min(tokens) >= 0):
        return _one_row_each(chunks, rows, tokens)
    if not rows:
        return chunk_results_general(chunks, tokens, row_counts, kept, positions, logprobs)
    token_ids, errors = _decode_rows(tokens[:rows], positions)
    more, more_errors, last = chunk_results_general(
        chunks, tokens, row_counts, kept, positions, logprobs, first=rows, first_row=rows)
    return token_ids + more, errors + more_errors, last


def chunk_results_general(
    chunks: Sequence[ScheduledChunk], tokens: list[int], row_counts: Sequence[int], kept: dict[int, int],
    positions: Sequence[int], logprobs: list[list[dict[int, Logprob]]] | None, *, first: int = 0,
    first_row: int = 0,
) -> tuple[list[list[int]], list[str | None], dict[str, int]]:
    """:func:`chunk_results` chunk by chunk, for any round (the reference of its shortcut
    for a round where every chunk drew one sampled row); ``chunks`` are the batch's from
    index ``first`` on (``row_counts``, ``kept`` and ``logprobs`` indexed by batch index),
    their rows from ``first_row`` on."""
    token_ids: list[list[int]] = []
    errors: list[str | None] = []
    last: dict[str, int] = {}
    row = first_row
    for i, (chunk, count) in enumerate(zip(chunks, row_counts[first:]), first):
        drawn = tokens[row : row + kept.get(i, count)]
        error = _sentinel_error(drawn, positions[row]) if drawn else None
        errors.append(error)
        if error is not None:
            drawn = []
        elif drawn and chunk.sampling is not None and chunk.sampling.needs_history:
            last[chunk.request_id] = drawn[-1] if i in kept else drawn[0]
        if logprobs is not None and i in kept:
            logprobs[i] = logprobs[i][: len(drawn)]
        token_ids.append(drawn)
        row += count
    return token_ids, errors, last


def _one_row_each(chunks: Sequence[ScheduledChunk], rows: int, tokens: list[int]) -> tuple[
        list[list[int]], list[str | None], dict[str, int]]:
    """:func:`chunk_results` of a round where every chunk drew one row and every row was
    sampled (no sentinel, nothing verified): the same lists, without the per-chunk checks.
    The first ``rows`` tokens are the decode rows' (which read no history)."""
    last = {
        chunk.request_id: token for chunk, token in zip(chunks, tokens[rows:])
        if chunk.sampling is not None and chunk.sampling.needs_history
    }
    return [[t] for t in tokens], [None] * len(tokens), last


def _decode_rows(tokens: list[int], positions: Sequence[int]) -> tuple[list[list[int]], list[str | None]]:
    """The token lists and errors of the decode rows (one row each, batch rows
    ``0..len(tokens)``), with :func:`chunk_results_general`'s sentinel rules."""
    token_ids: list[list[int]] = []
    errors: list[str | None] = []
    for row, token in enumerate(tokens):
        if token >= 0:
            token_ids.append([token])
            errors.append(None)
        else:
            token_ids.append([])
            errors.append(_sentinel_error([token], positions[row]))
    return token_ids, errors


def _sentinel_error(drawn: Sequence[int], position: int) -> str | None:
    """The error of a chunk whose drawn tokens hold a token slots' sentinel, the first
    row's output ``position`` named: it continued from a token never sampled
    (:data:`CONTINUED_UNSAMPLED`), or a row's logits were not finite (:data:`UNSAMPLED`);
    ``None`` when there is neither."""
    if CONTINUED_UNSAMPLED in drawn:
        return NEVER_SAMPLED
    if UNSAMPLED in drawn:
        return f"non-finite logits (NaN or inf) at output position {position}"
    return None


def host_rows(counts: torch.Tensor | None) -> list[list[int]] | None:
    """``counts`` (``[L, X]`` on any device) as host lists, or ``None`` (a host read: the
    trace's routing counts, taken when the step finishes)."""
    if counts is None:
        return None
    rows: list[list[int]] = counts.tolist()
    return rows
