"""Configs and records of the sched package: the limits of a round, and the plan of one.

A plan is made of snapshots: each chunk carries the token ids to feed, a copy of the
block table and its sampling row, never a live ``Request``. The runner (and under overlap
a worker thread) can lay a plan out while the scheduler already mutates its requests.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from deepinfer_kit._validators import int_at_least, one_of
from deepinfer_kit.cache.tiers.records import TransferPlan
from deepinfer_kit.outputs import RequestOutput
from deepinfer_kit.sample.params import SamplingParams

__all__ = [
    "SchedulerConfig", "SamplingRow", "ScheduledChunk", "DecodeChunk", "DecodeRows", "SchedulePlan",
    "PlainDecodeRun", "StretchResult",
]


@attrs.frozen(slots=True)
class SchedulerConfig:
    """Limits of one scheduling round.

    Attributes:
        max_num_seqs: requests in one round at most.
        max_num_batched_tokens: the token budget ``B_t`` of one round (``sum q_i <= B_t``).
        max_model_len: prompt plus output tokens of one request at most.
        enable_chunked_prefill: split prompts longer than the remaining budget.
        long_prefill_token_threshold: a prefill chunk is capped at this many tokens so
            decodes are not starved by one long prompt; 0 disables the cap.
        policy: ``"fcfs"`` (arrival order) or ``"priority"`` (lower ``priority`` first,
            then arrival) for admission and for choosing preemption victims.
    """

    max_num_seqs: int = attrs.field(default=256, validator=int_at_least(1))
    max_num_batched_tokens: int = attrs.field(default=2048, validator=int_at_least(1))
    max_model_len: int = attrs.field(default=4096, validator=int_at_least(1))
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = attrs.field(default=0, validator=int_at_least(0))
    policy: str = attrs.field(default="fcfs", validator=one_of(("fcfs", "priority")))


@attrs.define(slots=True, eq=False)
class SamplingRow:
    """What the sampler needs of a sequence that never changes: built once per sequence
    and shared by all its chunks (the per-round parts live on :class:`ScheduledChunk`).

    Attributes:
        params: the request's sampling parameters (immutable).
        seed: the sequence's seed, or ``None`` (a fork's row ``i`` derives its own with
            :func:`~deepinfer_kit.request.fork_seed`).
        prompt_token_ids: the prompt (never mutated; shared, not copied).
        eos_token_id: the EOS id masked while ``min_tokens`` is not reached, or ``None``.
        needs_history: the parameters read the generated tokens (penalties,
            ``min_tokens``, bad words, a structured-output grammar), so chunks carry a
            copy of them.
    """

    params: SamplingParams
    seed: int | None
    prompt_token_ids: Sequence[int]
    eos_token_id: int | None
    needs_history: bool


@attrs.define(slots=True, eq=False)
class ScheduledChunk:
    """The work of one sequence in one round, as a self-contained snapshot.

    The model is fed ``num_tokens`` tokens at positions ``[start, start + num_tokens)``:
    ``token_ids`` (known values), then ``num_placeholders`` tokens whose values a step
    still in flight is sampling (resolved on the device under overlap), then
    ``spec_token_ids`` (drafts verified this round), then room for ``draft_room`` drafts
    the runner proposes itself (overlapped speculation). So
    ``len(token_ids) + num_placeholders + len(spec_token_ids) + draft_room == num_tokens``.

    Attributes:
        request_id: the sequence's id (a fork child's is ``"{parent}#{index}"``).
        start: first position computed (a prefix hit moves it past the cached tokens).
        num_tokens: ``q_i``, tokens fed this round (counts against the budget).
        token_ids: the known token values fed, a copy.
        block_table: the sequence's physical blocks after this round's allocation, a
            copy; position ``t`` lives in ``block_table[t // P]``. Read-only: the chunks
            of one sequence share one copy over the rounds its table stays unchanged.
        sample: True when logits at the chunk's last non-draft position are sampled (the
            chunk reaches the end of the known tokens); False for a non-final prefill chunk.
        num_samples: tokens drawn from those logits (``n`` when the request forks into
            ``n`` completions at this sample, else 1).
        spec_token_ids: draft tokens appended after the known tokens; the verifier reads
            logits at ``1 + len(spec_token_ids)`` positions. ``()`` (one shared empty
            tuple, not a fresh list per chunk) when there are none.
        num_placeholders: tokens (0 or 1) whose values the step in flight produces.
        pending_drafts: with a placeholder, the drafts the step in flight may still reject
            before it: ``start`` (and ``output_position``) assume it accepts them all, and
            each one it rejects moves this chunk down one position. The runner and the
            scheduler's commit both derive that shift from the in-flight step's result.
        draft_room: drafts the runner may append to this decode chunk itself, from the
            sequence's newest tokens (overlapped speculation: the host cannot draft from
            tokens still in flight); ``num_tokens``, the budget and the blocks count them.
        preemption_epoch: the sequence's preemption count when scheduled; ``commit``
            ignores a chunk whose sequence was preempted since.
        sampling: the sequence's sampling row when ``sample`` is True, else ``None``.
        num_cached_tokens: prompt tokens this (re)admission took from the prefix cache;
            0 except on a sequence's first chunk after admission (traces).
        output_position: index of the output token this chunk's sample draws (0 for the
            first); it keys the seeded random stream and the ``min_tokens`` rule.
        output_token_ids: a copy of the tokens generated so far when
            ``sampling.needs_history`` or ``draft_room`` (the runner drafts from them),
            else empty.
        prompt_targets: for a request with ``prompt_logprobs``, the prompt tokens whose
            logprobs this chunk's positions give: position ``prompt_first + j`` predicts
            ``prompt_targets[j]`` (the prompt token after it); ``()`` otherwise.
        prompt_first: the first such position.
        prompt_top: the request's ``prompt_logprobs`` (top alternatives per position).
    """

    request_id: str
    start: int
    num_tokens: int
    token_ids: list[int]
    block_table: list[int]
    sample: bool = True
    num_samples: int = 1
    spec_token_ids: Sequence[int] = ()
    num_placeholders: int = 0
    preemption_epoch: int = 0
    sampling: SamplingRow | None = None
    num_cached_tokens: int = 0
    output_position: int = 0
    output_token_ids: Sequence[int] = ()
    prompt_targets: Sequence[int] = ()
    prompt_first: int = 0
    prompt_top: int = 0
    pending_drafts: int = 0
    draft_room: int = 0

    @property
    def end(self) -> int:
        """One past the last position computed."""
        return self.start + self.num_tokens

    @property
    def is_prefill(self) -> bool:
        """True when the chunk computes prompt tokens (or recomputes after preemption)."""
        return self.num_tokens - len(self.spec_token_ids) - self.draft_room > 1 or not self.sample

    def shift(self, emitted: int) -> int:
        """How far this chunk moves down once the round in flight before it emitted
        ``emitted`` tokens: its ``pending_drafts`` minus the drafts that round accepted
        (``emitted - 1``). Negative when that round emitted more than the chunk assumed
        (a broken plan). The one rule both the runner (resolving the chunk as it runs)
        and the scheduler's commit (moving its records) apply."""
        return self.pending_drafts - (emitted - 1)


class DecodeChunk(ScheduledChunk):
    """A plain decode's chunk (one known token, sampled, nothing else): a
    :class:`ScheduledChunk` whose fields that are the same for every plain decode live
    once on the class, so the scheduler sets only the seven that vary (``request_id``,
    ``start``, ``token_ids``, ``block_table``, ``preemption_epoch``, ``sampling``,
    ``output_position``) — it builds one per decoding sequence and round.

    Reads, ``attrs.fields``/``asdict``/``evolve`` and pickling behave as for any chunk
    (a field set on an instance, e.g. by ``evolve``, shadows the class value).
    ``DecodeChunk(...)`` takes every field, as :class:`ScheduledChunk` does; the
    scheduler's fast path makes one with ``object.__new__`` and sets the seven.
    """

    num_tokens = 1
    sample = True
    num_samples = 1
    spec_token_ids: Sequence[int] = ()
    num_placeholders = 0
    num_cached_tokens = 0
    output_token_ids: Sequence[int] = ()
    prompt_targets: Sequence[int] = ()
    prompt_first = 0
    prompt_top = 0
    pending_drafts = 0
    draft_room = 0


_new = object.__new__


@attrs.define(slots=True, eq=False)
class DecodeRows:
    """A round's plain decodes as columns: row ``i`` feeds the one known token
    ``token_ids[i]`` at position ``starts[i]`` (its sequence's length is then
    ``starts[i] + 1``), reads and writes KV through ``block_tables[i]`` and draws one token
    with ``sampling[i]`` at output index ``output_positions[i]``. Nothing else: no
    placeholder, draft, draft room, fork, prompt logprobs or history (a row whose
    parameters read the generated tokens is a :class:`ScheduledChunk` record instead).

    Each row is exactly the :class:`DecodeChunk` that :meth:`chunk` builds; the columns
    are the form the scheduler writes and the runner, the plan codec and the simulator
    read, one list per field instead of one object per sequence and round. Snapshots,
    like a chunk: a block table is a copy (shared by the rounds it stays unchanged) and
    read-only. All columns have the same length.
    """

    request_ids: list[str] = attrs.field(factory=list)
    starts: list[int] = attrs.field(factory=list)
    token_ids: list[int] = attrs.field(factory=list)
    block_tables: list[list[int]] = attrs.field(factory=list)
    preemption_epochs: list[int] = attrs.field(factory=list)
    sampling: list[SamplingRow] = attrs.field(factory=list)
    output_positions: list[int] = attrs.field(factory=list)

    def __len__(self) -> int:
        return len(self.request_ids)

    def append(self, request_id: str, start: int, token_id: int, block_table: list[int], preemption_epoch: int,
               sampling: SamplingRow, output_position: int) -> None:
        """Add one row at the end (the scheduler's fast path appends to the columns
        directly; this is the spelling for everyone else)."""
        self.request_ids.append(request_id)
        self.starts.append(start)
        self.token_ids.append(token_id)
        self.block_tables.append(block_table)
        self.preemption_epochs.append(preemption_epoch)
        self.sampling.append(sampling)
        self.output_positions.append(output_position)

    def chunk(self, i: int) -> DecodeChunk:
        """Row ``i`` as a :class:`DecodeChunk` record (a new object; the table and the
        sampling row shared, not copied). Raises ``IndexError`` past the end."""
        chunk = _new(DecodeChunk)
        chunk.request_id = self.request_ids[i]
        chunk.start = self.starts[i]
        chunk.token_ids = [self.token_ids[i]]
        chunk.block_table = self.block_tables[i]
        chunk.preemption_epoch = self.preemption_epochs[i]
        chunk.sampling = self.sampling[i]
        chunk.output_position = self.output_positions[i]
        return chunk

    def to_chunks(self) -> list[ScheduledChunk]:
        """Every row as a record, in order (O(rows))."""
        return [self.chunk(i) for i in range(len(self.request_ids))]

    def drop(self, i: int) -> None:
        """Remove row ``i`` from every column (a sequence preempted after it was planned
        this round). Raises ``IndexError`` past the end."""
        for column in (self.request_ids, self.starts, self.token_ids, self.block_tables,
                       self.preemption_epochs, self.sampling, self.output_positions):
            del column[i]


@attrs.define(slots=True, eq=False)
class SchedulePlan:
    """One round: who runs, how many tokens each, and what the runner must do first.

    The round's batch is ``decodes`` (its plain decodes, as columns) followed by
    ``chunks`` (every other chunk, as records): chunk ``i`` of the batch is decode row
    ``i`` for ``i < len(decodes)``, else ``chunks[i - len(decodes)]``. A
    :class:`~deepinfer_kit.step.StepResult` is aligned with that order
    (:meth:`all_chunks`); :attr:`num_chunks` counts both.

    Attributes:
        step_id: increasing round number.
        chunks: the scheduled work that is not a plain decode (prefills, verified drafts,
            placeholders, forks, rows that read history or want prompt logprobs), in
            the order the runner lays it out after the decode rows.
        block_copies: ``(src, dst)`` block copies (copy-on-write) to perform on the device
            before the forward.
        preempted_ids: sequences preempted this round (their blocks were released).
        finished_ids: sequences that ended without running since the last plan (aborted,
            or rejected because they can never fit); reported by the next commit.
        num_batched_tokens: ``sum q_i`` over the batch (decode rows and chunks).
        token_budget: ``B_t`` of this round.
        num_cached_tokens: prompt tokens served from the prefix cache for the requests
            admitted (or resumed) this round; counted at this round's match, for traces.
        decodes: the plain decodes of the round (:class:`DecodeRows`), laid out first.
            A plan built by hand may leave them empty and hold plain decodes as records.
        table_updates: ``(group, full_block, group_block)`` block mappings of the cache's
            sliding-window groups set while this round was planned
            (``HybridKVCacheManager.drain_table_updates``), applied on the device before
            the block copies and the forward; empty for a cache without groups.
        kv_transfers: the copies between the device pool and the host KV tier that the
            round runs around its block copies (``TieredKVCacheManager.drain_kv_transfers``;
            docs/kv_tiers.md); ``None`` without tiers or when there are none.
    """

    step_id: int
    chunks: list[ScheduledChunk] = attrs.field(factory=list)
    block_copies: list[tuple[int, int]] = attrs.field(factory=list)
    preempted_ids: list[str] = attrs.field(factory=list)
    finished_ids: list[str] = attrs.field(factory=list)
    num_batched_tokens: int = 0
    token_budget: int = 0
    num_cached_tokens: int = 0
    decodes: DecodeRows = attrs.field(factory=DecodeRows)
    table_updates: list[tuple[int, int, int]] = attrs.field(factory=list)
    kv_transfers: TransferPlan | None = None

    @property
    def is_empty(self) -> bool:
        """True when nothing runs on the device this round."""
        return not self.chunks and not self.decodes.request_ids

    @property
    def num_chunks(self) -> int:
        """Chunks in the batch: decode rows plus records."""
        return len(self.decodes.request_ids) + len(self.chunks)

    def all_chunks(self) -> list[ScheduledChunk]:
        """The whole batch as records, in batch order (decode rows first, each as a new
        :class:`DecodeChunk`; then ``chunks``, the same objects). O(chunks)."""
        if not self.decodes.request_ids:
            return list(self.chunks)
        return self.decodes.to_chunks() + self.chunks

    def request_ids(self) -> list[str]:
        """Each chunk's sequence id, in batch order."""
        return self.decodes.request_ids + [c.request_id for c in self.chunks]

    def as_records(self) -> SchedulePlan:
        """This plan with its decode rows as records (``decodes`` empty, the batch
        unchanged): for a reader that handles records only. ``self`` when it has no
        decode rows."""
        if not self.decodes.request_ids:
            return self
        return attrs.evolve(self, chunks=self.all_chunks(), decodes=DecodeRows())


@attrs.frozen(slots=True)
class PlainDecodeRun:
    """The running set when the next rounds are plain decodes of every running sequence
    and nothing else (:meth:`BatchScheduler.plain_decode_run`), as columns in running
    order. Snapshots: nothing here changes when the scheduler does.

    Attributes:
        request_ids: each sequence's id.
        starts: each sequence's next chunk start (the position of the token it feeds);
            round ``r`` of the run feeds position ``starts[i] + r``.
        output_positions: the output index each sequence samples in the run's first
            round (``r``-th round: plus ``r``).
        max_rounds: rounds before the first sequence reaches its length limit (a token
            sampled in the round after them may end it by length): ``>= 1``.
    """

    request_ids: list[str]
    starts: list[int]
    output_positions: list[int]
    max_rounds: int


@attrs.frozen(slots=True)
class StretchResult:
    """What :meth:`BatchScheduler.advance_plain_decodes` applied.

    Attributes:
        frees: the cache's ``num_free_blocks`` after each applied round's planning (one
            entry per round; empty: nothing applied).
        outputs: the sequences the last round finished, as its ``commit`` reports them.
    """

    frees: list[int]
    outputs: list[RequestOutput]
