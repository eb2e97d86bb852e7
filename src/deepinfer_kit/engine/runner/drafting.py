"""RunnerDrafting: speculation on the runner's side — each round's chunks are resolved and
drafted for only when the round executes, after the round before it, so the runner knows
what that round accepted. It is the one drafting path: in-process or in a worker process,
synchronous or overlapped, the runner drafts (``build_device`` gives it to the runner's
constructor) and the engine holds no speculation state.

The scheduler plans every decode chunk with room for drafts (``ScheduledChunk.draft_room``,
``BatchScheduler.reserve_drafts``). Under overlap the host plans round ``k + 1`` while round
``k`` verifies its drafts: it cannot know how many round ``k`` accepts (so where round ``k +
1`` starts), nor draft from tokens it has not seen. Its decode chunks are therefore planned
optimistically (``ScheduledChunk.pending_drafts``: round ``k``'s drafts all accepted); the
runner, which executes rounds in order, resolves each chunk when round ``k + 1`` starts
executing:

- the chunk moves down by the drafts round ``k`` rejected (``pending_drafts`` minus the
  accepted count), its input is the last token round ``k`` emitted, its output position
  moves with it; the scheduler's commit of round ``k`` moves its own record the same way
  (``StepResult.shifts``);
- its drafts are proposed now by the engine's drafter (prompt lookup, or a draft model
  over its own KV) from the prompt, the committed outputs and round ``k``'s tokens — the
  context a host drafting before the round would see — and cut by the verify planner
  (:meth:`Speculation.choose`) and the chunk's room.

Synchronous rounds have no placeholders: each chunk is drafted for from its snapshot.

A drafter with KV of its own keeps each sequence's state while the sequence holds a token
slot (this class is then a :class:`~deepinfer_kit.engine.runner.token_slots.SlotFollower`):
it is rolled back to the accepted tokens before each round drafts and released when the
slot is. A runner without token slots (a synchronous engine) keeps a sequence's state
while it has a chunk in each round: the first round without it releases it (as a slot
would be) and, at the idle check, the last round's sequences are released.

A chunk whose round ``k`` produced nothing (it failed, or its logits were not finite) is
reported as an error; its request was already ended by round ``k``'s commit.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from deepinfer_kit.spec.speculation import Speculation
from deepinfer_kit.engine.runner.token_slots import NEVER_SAMPLED
from deepinfer_kit.errors import InvariantError
from deepinfer_kit.outputs import Logprob
from deepinfer_kit.sched.records import ScheduledChunk, SchedulePlan
from deepinfer_kit.spec.records import DraftView
from deepinfer_kit.step import StepResult

if TYPE_CHECKING:
    from deepinfer_kit.engine.runner.token_slots import TokenSlots

__all__ = ["LateStep", "RunnerDrafting"]



@attrs.frozen(slots=True)
class LateStep:
    """A plan whose layout waits until it executes (``ModelRunner.prepare`` under
    :class:`RunnerDrafting`); ``record_expert_counts`` as given to ``prepare``."""

    plan: SchedulePlan
    record_expert_counts: bool = False


class RunnerDrafting:
    """Resolves and drafts the chunks of overlapped speculative rounds (module docstring).

    Args:
        speculation: the drafter, the verify planner and γ (``num_draft``, the most
            drafts per chunk: the scheduler's ``draft_room``); its draft distributions
            are the runner's ``draft_probs``.
        slots: the runner's token slots: they release the sequences (:meth:`release`;
            this object registers as their follower). ``None`` for a runner without them
            (a synchronous engine): a round releases the sequences it has no chunk of.
        clock: seconds, read around each round's execution when the speculation corrects
            its curve online (``speculation.measured``); never read otherwise.
    """

    def __init__(self, speculation: Speculation, *, slots: TokenSlots | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.speculation = speculation
        self._clock = clock if speculation.measured is not None else None
        self._emitted: dict[str, list[int]] = {}  # sequence id -> tokens of its last round
        self._stateful = speculation.stateful
        self._views: dict[str, DraftView] = {}  # stateful drafter: sequences it may hold
        self._released: deque[str] = deque()  # slots freed since the last round (any thread)
        self._follows_slots = slots is not None
        self._last_round: set[str] = set()  # without slots: the sequences of the last round
        if slots is not None:
            slots.followers.append(self)

    def resolve(self, plan: SchedulePlan) -> tuple[SchedulePlan, list[int], list[str | None]]:
        """``(resolved plan, index in plan of each resolved chunk, error per chunk of
        plan)``: chunks that could not be resolved are left out and named in the errors.
        Reads what :meth:`record` kept of the round before; mutates the drafter's state
        (a draft model's KV). O(chunks + drafter + planner). A plan's decode rows are
        read as records (:meth:`SchedulePlan.as_records`: the batch order is kept)."""
        plan = plan.as_records()
        if not self._follows_slots and self._stateful:
            present = {c.request_id for c in plan.chunks}
            self._released.extend(sid for sid in self._views if sid not in present)
            self._last_round = present
        self._apply_releases()
        emitted = self._emitted
        errors: list[str | None] = [None] * len(plan.chunks)
        kept: list[int] = []
        chunks: list[ScheduledChunk] = []
        views: list[DraftView] = []
        wanted: list[int] = []  # index in chunks of each view's chunk
        for i, c in enumerate(plan.chunks):
            if not c.num_placeholders and not c.draft_room:
                kept.append(i)
                chunks.append(c)
                continue
            shift, tokens = 0, list(c.token_ids)
            history: tuple[int, ...] = tuple(c.output_token_ids)
            new: tuple[int, ...] = ()
            if c.num_placeholders:
                prev = emitted.get(c.request_id)
                shift = c.shift(len(prev)) if prev else -1
                if prev is None or shift < 0:
                    errors[i] = NEVER_SAMPLED
                    continue
                tokens, new = [prev[-1]], tuple(prev)
            row = c.sampling
            if new and row is not None and (row.needs_history or c.draft_room):
                history = (*history, *new)
            if c.draft_room and row is not None:
                prompt = row.prompt_token_ids
                views.append(DraftView(c.request_id, prompt, history, [*prompt, *history], row.params,
                                       row.seed, row.eos_token_id))
                wanted.append(len(chunks))
            kept.append(i)
            chunks.append(attrs.evolve(
                c, start=c.start - shift, num_tokens=1, token_ids=tokens, num_placeholders=0,
                output_position=c.output_position - shift, output_token_ids=history,
                pending_drafts=0, draft_room=0,
            ))  # fmt: skip
        if views:
            spec = self.speculation
            # the round's tokens besides the drafted chunks' own: prefill, and decode chunks
            # without draft room (each one token) — what the planner sizes the round around
            other = sum(c.num_tokens for c in chunks) - len(views)
            if self._stateful:  # roll the drafter's KV back to what round k accepted
                for view in views:
                    self._views[view.request_id] = view
                spec.sync(list(self._views.values()))
            for j, view, drafts in zip(wanted, views, spec.choose(views, other)):
                room = plan.chunks[kept[j]].draft_room
                if drafts and room:
                    cut = tuple(drafts[:room])
                    chunks[j] = attrs.evolve(chunks[j], num_tokens=1 + len(cut), spec_token_ids=cut)
        resolved = SchedulePlan(plan.step_id, chunks, plan.block_copies, plan.preempted_ids,
                                plan.finished_ids, plan.num_batched_tokens, plan.token_budget,
                                plan.num_cached_tokens, table_updates=plan.table_updates,
                                kv_transfers=plan.kv_transfers)
        return resolved, kept, errors

    def release(self, seq_ids: list[str]) -> None:
        """The token slots of ``seq_ids`` were freed (:class:`SlotFollower`): their draft
        state goes before the next round drafts (this may run on the committing thread
        while a round executes, so nothing is touched here)."""
        if self._stateful:
            self._released.extend(seq_ids)

    def check_idle(self) -> None:
        """Raise :class:`InvariantError` unless the drafter holds no sequence and no block
        (the engine's idle check: through the token slots, or without them called by the
        worker with nothing in flight and no request live, so the last round's sequences
        have ended and are released first)."""
        if not self._follows_slots and self._stateful:
            self._released.extend(self._last_round)
            self._last_round = set()
        self._apply_releases()
        if self._views:
            raise InvariantError(f"runner drafting still holds sequences {sorted(self._views)}")
        self.speculation.check_idle()

    def _apply_releases(self) -> None:
        released = self._released
        if released:
            while released:  # popleft and append are atomic: no lock with the committing thread
                self._views.pop(released.popleft(), None)
            self.speculation.sync(list(self._views.values()))

    def run(self, plan: SchedulePlan, execute: Callable[[SchedulePlan], StepResult]) -> StepResult:
        """Resolve ``plan`` (:meth:`resolve`), ``execute`` the resolved plan (lay it out and
        run it), :meth:`record` what it emitted and return its result on ``plan``'s
        chunks. A round that raises is forgotten (the next one's placeholders fail). With
        an online curve, a round with decode chunks reports its size and the time
        ``execute`` took (sampled tokens on the host: forward, verification and sampler)
        to :meth:`Speculation.observe_round`."""
        plan = plan.as_records()
        resolved, kept, errors = self.resolve(plan)
        clock = self._clock
        start = clock() if clock is not None else 0.0
        try:
            result = execute(resolved)
        except BaseException:
            self.forget()
            raise
        if clock is not None and any(not c.is_prefill for c in resolved.chunks):
            self.speculation.observe_round(sum(c.num_tokens for c in resolved.chunks), clock() - start)
        self.record(resolved, result)
        merged = self.merge(result, kept, errors)
        if any(c.spec_token_ids for c in resolved.chunks):
            drafts: list[tuple[int, ...]] = [() for _ in plan.chunks]
            for j, i in enumerate(kept):
                drafts[i] = tuple(resolved.chunks[j].spec_token_ids)
            merged.drafts = drafts
        shifts = [0] * len(plan.chunks)
        for j, i in enumerate(kept):
            shifts[i] = plan.chunks[i].start - resolved.chunks[j].start
        if any(shifts):
            merged.shifts = shifts
        return merged

    def record(self, resolved: SchedulePlan, result: StepResult) -> None:
        """Keep each sequence's tokens of the round just executed (its parent's own token
        for a fork), for the next round's :meth:`resolve`; forgets the rounds before."""
        emitted: dict[str, list[int]] = {}
        for chunk, tokens in zip(resolved.chunks, result.token_ids):
            if chunk.sample and tokens:
                emitted[chunk.request_id] = tokens if chunk.num_samples == 1 else tokens[:1]
        self._emitted = emitted

    def forget(self) -> None:
        """A round failed: nothing it was to emit is known."""
        self._emitted = {}

    @staticmethod
    def merge(result: StepResult, kept: list[int], errors: list[str | None]) -> StepResult:
        """``result`` of the resolved plan, laid back onto the chunks of the plan (the ones
        left out get no tokens and their error)."""
        n = len(errors)
        token_ids: list[list[int]] = [[] for _ in range(n)]
        for j, i in enumerate(kept):
            token_ids[i] = result.token_ids[j]
        merged = list(errors)
        if result.errors:
            for j, i in enumerate(kept):
                merged[i] = result.errors[j]

        def spread(values: list[int]) -> list[int]:
            out = [0] * n
            for j, i in enumerate(kept):
                out[i] = values[j]
            return out

        logprobs: list[list[dict[int, Logprob]]] | None = None
        prompt_lps: list[list[dict[int, Logprob]]] | None = None
        if result.logprobs is not None:
            logprobs = [[] for _ in range(n)]
            for j, i in enumerate(kept):
                logprobs[i] = result.logprobs[j]
        if result.prompt_logprobs is not None:
            prompt_lps = [[] for _ in range(n)]
            for j, i in enumerate(kept):
                prompt_lps[i] = result.prompt_logprobs[j]
        return StepResult(
            token_ids=token_ids,
            logprobs=logprobs,
            num_drafted=spread(result.num_drafted) if result.num_drafted else [],
            num_accepted=spread(result.num_accepted) if result.num_accepted else [],
            errors=merged if any(e is not None for e in merged) else [],
            expert_counts=result.expert_counts,
            slot_counts=result.slot_counts,
            prompt_logprobs=prompt_lps,
            kv_transfers=result.kv_transfers,
        )
