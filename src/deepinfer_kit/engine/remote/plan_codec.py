"""PlanEncoder / PlanDecoder: a :class:`SchedulePlan` as bytes for a runner in another
process, each sequence's sampling row and block table sent once and then named.

A plan is mostly the same from one round to the next: a decoding sequence keeps its
sampling row (parameters, prompt) for its whole life and its block table for ``P``
tokens at a time. Pickling every chunk in full costs about 1 ms each way for 64 chunks
with their prompts; here a row or a table the worker already holds travels as a marker,
and the plan's decode rows travel as their columns (seven lists, not a tuple per row), so
a round of 256 plain decodes crosses in under a microsecond per row
(``benchmarks/bench_plan_codec.py``).

What the worker holds is decided by the host alone, and only from what the worker
confirmed: a value is sent in full until a reply says the message carrying it was decoded
(:meth:`PlanEncoder.confirm`), and only then named. A message the worker could not decode
(:meth:`PlanEncoder.reject`) confirms nothing, so a failure never leaves the two sides
disagreeing. A value that a plan no longer uses is dropped on both sides (the message
carries the ids to forget), so the worker holds only the sequences of the latest plan.
"""

from __future__ import annotations

import pickle
from typing import Any

from deepinfer_kit.sched.records import DecodeRows, SamplingRow, ScheduledChunk, SchedulePlan

__all__ = ["PlanEncoder", "PlanDecoder"]

_HELD = 0  # in place of a row or a table: the worker holds this sequence's already


class _Held:
    """Host side of one kind of per-sequence value the worker keeps (rows, tables)."""

    __slots__ = ("confirmed", "sent", "newest", "known")

    def __init__(self) -> None:
        self.confirmed: dict[str, object] = {}  # sequence id -> value the worker holds
        self.sent: dict[int, dict[str, object]] = {}  # message -> values sent in full in it
        self.newest: dict[str, tuple[int, object, int]] = {}  # sequence id -> (message,
        # value) of its newest full send not yet settled by a reply, and the first message
        # of the run of messages sending that value since a change, a forget or a rejection
        # (only a reply to one of those proves the worker will hold it)
        self.known: set[str] = set()  # sequences the worker may hold a value of

    def forgettable(self, used: set[str]) -> list[str]:
        """Sequences the worker may hold that a plan using ``used`` does not."""
        return [s for s in self.known if s not in used]

    def commit(self, message: int, full: dict[str, object], forget: list[str]) -> None:
        """``message`` sent ``full`` and told the worker to ``forget``."""
        confirmed, newest = self.confirmed, self.newest
        for seq_id, value in full.items():
            held = confirmed.get(seq_id)
            if held is not None and held is not value:  # the worker's value changes
                del confirmed[seq_id]
            entry = newest.get(seq_id)
            same = entry is not None and entry[1] is value  # a run of sends of one value
            newest[seq_id] = (message, value, entry[2] if same and entry is not None else message)
            self.known.add(seq_id)
        if full:
            self.sent[message] = full
        for seq_id in forget:  # a confirmation still on its way must not revive it
            self.known.discard(seq_id)
            confirmed.pop(seq_id, None)
            newest.pop(seq_id, None)

    def confirm(self, message: int) -> None:
        """The worker decoded ``message``: a value it carried is held from now on unless a
        later message (still unanswered) carries another one."""
        newest = self.newest
        for seq_id, value in self.sent.pop(message, {}).items():
            entry = newest.get(seq_id)
            if entry is None or entry[1] is not value or message < entry[2]:
                continue
            self.confirmed[seq_id] = value
            if entry[0] == message:
                del newest[seq_id]

    def reject(self, message: int) -> None:
        """The worker could not decode ``message``: what it holds of the sequences the
        message carried is what a later message sends in full, or unknown."""
        for seq_id in self.sent.pop(message, {}):
            self.confirmed.pop(seq_id, None)
            entry = self.newest.get(seq_id)
            if entry is None:
                continue
            if entry[0] == message:
                del self.newest[seq_id]
            else:  # only replies to messages after this one prove what the worker holds
                self.newest[seq_id] = (entry[0], entry[1], max(entry[2], message + 1))


class PlanEncoder:
    """Host side: turns plans into messages for one :class:`PlanDecoder`, in order."""

    def __init__(self) -> None:
        self._rows = _Held()
        self._tables = _Held()
        self._next = 0

    def encode(self, plan: SchedulePlan) -> tuple[int, bytes]:
        """``(message id, bytes)`` of ``plan``. Mutates the encoder only once the bytes
        exist (an unpicklable field raises and changes nothing).

        Raises:
            pickle.PicklingError, TypeError, AttributeError: a field cannot be pickled.
        """
        rows, tables = self._rows.confirmed, self._tables.confirmed
        full_rows: dict[str, object] = {}
        full_tables: dict[str, object] = {}

        def row_of(rid: str, row: SamplingRow) -> Any:
            if rows.get(rid) is row:
                return _HELD
            full_rows[rid] = row
            return (row.params, row.seed, row.prompt_token_ids, row.eos_token_id, row.needs_history)

        def table_of(rid: str, table: object) -> Any:
            if tables.get(rid) is table:
                return _HELD
            full_tables[rid] = table
            return table

        d = plan.decodes
        decodes = (
            d.request_ids, d.starts, d.token_ids, [table_of(r, t) for r, t in zip(d.request_ids, d.block_tables)],
            d.preemption_epochs, [row_of(r, w) for r, w in zip(d.request_ids, d.sampling)], d.output_positions,
        )  # fmt: skip
        chunks = []
        for c in plan.chunks:
            rid, row = c.request_id, c.sampling
            chunks.append((
                rid, c.start, c.num_tokens, c.token_ids, table_of(rid, c.block_table), c.sample, c.num_samples,
                c.spec_token_ids, c.num_placeholders, c.preemption_epoch, None if row is None else row_of(rid, row),
                c.num_cached_tokens, c.output_position, c.output_token_ids, c.prompt_targets,
                c.prompt_first, c.prompt_top, c.pending_drafts, c.draft_room,
            ))  # fmt: skip
        used = set(d.request_ids).union(c.request_id for c in plan.chunks)
        message = self._next
        forget_rows = self._rows.forgettable(used)
        forget_tables = self._tables.forgettable(used)
        body = (
            message, forget_rows, forget_tables, plan.step_id, decodes, chunks, plan.block_copies,
            plan.preempted_ids, plan.finished_ids, plan.num_batched_tokens, plan.token_budget,
            plan.num_cached_tokens, plan.table_updates, plan.kv_transfers,
        )  # fmt: skip
        data = pickle.dumps(body, protocol=pickle.HIGHEST_PROTOCOL)
        self._next += 1
        self._rows.commit(message, full_rows, forget_rows)
        self._tables.commit(message, full_tables, forget_tables)
        return message, data

    def confirm(self, message: int) -> None:
        """The worker decoded ``message``: what it sent in full may be named from now on.
        Called in message order, by the host, when the message's reply arrives."""
        self._rows.confirm(message)
        self._tables.confirm(message)

    def reject(self, message: int) -> None:
        """The worker could not decode ``message``: it holds nothing of what it carried."""
        self._rows.reject(message)
        self._tables.reject(message)

    @property
    def num_known(self) -> tuple[int, int]:
        """``(rows, tables)`` the worker may hold: a decoder that decoded every message
        holds exactly these (for tests)."""
        return len(self._rows.known), len(self._tables.known)


class PlanDecoder:
    """Worker side: rebuilds the plans of one :class:`PlanEncoder`, in order."""

    def __init__(self) -> None:
        self._rows: dict[str, SamplingRow] = {}
        self._tables: dict[str, list[int]] = {}

    def decode(self, data: bytes) -> tuple[int, SchedulePlan]:
        """``(message id, plan)`` of an encoder's message. Mutates the decoder only when
        the whole message decoded.

        Raises:
            KeyError: the message names a value this decoder does not hold (a message
                skipped or decoded out of order).
            pickle.UnpicklingError, AttributeError, ImportError: undecodable bytes.
        """
        (message, forget_rows, forget_tables, step_id, (ids, starts, tokens, table_codes, epochs, row_codes, outs),
         encoded, block_copies, preempted, finished, num_batched, budget, num_cached,
         table_updates, kv_transfers) = pickle.loads(data)  # fmt: skip
        rows, tables = self._rows, self._tables
        new_rows: dict[str, SamplingRow] = {}
        new_tables: dict[str, list[int]] = {}
        decode_rows = [rows[rid] if code == _HELD else new_rows.setdefault(rid, SamplingRow(*code))
                       for rid, code in zip(ids, row_codes)]
        decode_tables = [tables[rid] if code == _HELD else new_tables.setdefault(rid, code)
                         for rid, code in zip(ids, table_codes)]
        decodes = DecodeRows(ids, starts, tokens, decode_tables, epochs, decode_rows, outs)
        chunks: list[ScheduledChunk] = []
        for (rid, start, num_tokens, token_ids, table_code, sample, num_samples, spec,
             holes, epoch, row_code, cached, out_pos, out_ids, targets, first, top, pending,
             room) in encoded:  # fmt: skip
            if row_code is None:
                row = None
            elif row_code == _HELD:
                row = rows[rid]
            else:
                row = new_rows[rid] = SamplingRow(*row_code)
            if table_code == _HELD:
                table = tables[rid]
            else:
                table = new_tables[rid] = table_code
            chunks.append(ScheduledChunk(
                rid, start, num_tokens, token_ids, table, sample, num_samples, spec, holes,
                epoch, row, cached, out_pos, out_ids, targets, first, top, pending, room,
            ))  # fmt: skip
        for rid in forget_rows:
            rows.pop(rid, None)
        for rid in forget_tables:
            tables.pop(rid, None)
        rows.update(new_rows)
        tables.update(new_tables)
        plan = SchedulePlan(step_id, chunks, block_copies, preempted, finished, num_batched, budget, num_cached,
                            decodes, table_updates, kv_transfers=kv_transfers)
        return message, plan

    @property
    def num_held(self) -> tuple[int, int]:
        """``(rows, tables)`` this decoder holds (for tests)."""
        return len(self._rows), len(self._tables)
