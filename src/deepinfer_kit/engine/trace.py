"""StepTrace: a record of what one engine step did, for following requests step by step."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from deepinfer_kit.outputs import RequestOutput
from deepinfer_kit.sched.records import SamplingRow, SchedulePlan
from deepinfer_kit.step import RankStats, StepResult

__all__ = ["TracedChunk", "StepTrace", "make_trace", "token_timeline", "describe_rank"]


def describe_rank(stats: RankStats) -> str:
    """One line describing a rank's round: its run time, its collectives (count, time,
    share of the run, KiB sent) and its resident weight and KV bytes (MiB)."""
    share = stats.comm_s / stats.run_s if stats.run_s > 0 else 0.0
    return (f"rank {stats.rank}: run {stats.run_s * 1e3:.1f} ms, collectives {stats.comm_calls} "
            f"({stats.comm_s * 1e3:.1f} ms, {share:.0%}, {stats.comm_bytes / 2**10:.1f} KiB), "
            f"weights {stats.weight_bytes / 2**20:.2f} MiB, KV {stats.kv_bytes / 2**20:.2f} MiB")


@attrs.frozen(slots=True)
class TracedChunk:
    """One request's work in a step.

    Attributes:
        request_id: the sequence's id (fork children: ``"{parent}#{index}"``).
        kind: ``"prefill"`` (prompt or recompute tokens) or ``"decode"``.
        start: first position computed.
        num_tokens: tokens computed (``q_i``).
        num_cached_tokens: prompt tokens served from the prefix cache (on admission).
        sampled: tokens appended to the sequence by this step.
        num_blocks: blocks the request held when the step ran.
        num_drafted: draft tokens verified in this chunk (0 without speculation).
        num_accepted: drafts accepted (``sampled`` holds them plus one target token).
        drafted: the draft token ids verified in this chunk (empty without speculation).
        candidates: per token of ``sampled``, ``(token_id, logprob, rank)`` of the drawn
            token and the top alternatives, rank order (rank 1 = most likely under the
            raw logits, before penalties and filters); empty unless the request asked
            for ``logprobs``.
        block_table: the physical blocks the request held when the step ran.
        row: the request's sampling row (params, prompt) when the chunk samples, else
            ``None``.
        output_position: the output index of ``sampled[0]`` (with drafts, ``sampled[k]``
            is index ``output_position + k``; a fork's ``sampled[j]`` is completion
            ``j``'s first token).
    """

    request_id: str
    kind: str
    start: int
    num_tokens: int
    num_cached_tokens: int
    sampled: tuple[int, ...]
    num_blocks: int
    num_drafted: int = 0
    num_accepted: int = 0
    drafted: tuple[int, ...] = ()
    candidates: tuple[tuple[tuple[int, float, int], ...], ...] = ()
    block_table: tuple[int, ...] = ()
    row: SamplingRow | None = None
    output_position: int = 0


@attrs.frozen(slots=True)
class StepTrace:
    """What one :meth:`Engine.step` did.

    Attributes:
        step_id: the plan's step number.
        chunks: the scheduled work, in batch order.
        num_batched_tokens: ``sum q_i``; ``token_budget``: ``B_t``.
        free_blocks_before, free_blocks_after: free + evictable blocks around the step.
        blocks_evicted: cached blocks whose identity was evicted during the step.
        prefix_hit_tokens: prompt tokens served from the prefix cache in this step.
        block_copies: copy-on-write copies performed; ``copied_blocks`` the
            ``(source, destination)`` physical block of each.
        preempted: ids preempted this step; finished: ids that finished this step.
        expert_counts: per MoE layer, tokens routed to each expert (``[L_moe][E]``).
        slot_counts: with EPLB on, per MoE layer, token copies each physical expert slot
            served (``[L_moe][P]``; slot ``s`` is on GPU ``s // (P / G)``); else None.
        num_drafted, num_accepted: drafts verified and accepted over all chunks.
        schedule_s, execute_s, commit_s: wall time of each phase.
        ranks: with a multi-rank model (``tensor_parallel`` / ``expert_parallel`` worker
            ranks), each rank's time, collectives and resident bytes in this round.
        committed_in: the newest step scheduled when this one was committed: ``step_id``
            for a synchronous engine, ``step_id + 1`` under overlap (tokens sampled in
            step ``k`` land one step late). ``chunks[i].sampled`` were sampled in
            ``step_id`` and became part of the requests in ``committed_in``.
    """

    step_id: int
    chunks: tuple[TracedChunk, ...]
    num_batched_tokens: int
    token_budget: int
    free_blocks_before: int
    free_blocks_after: int
    blocks_evicted: int
    prefix_hit_tokens: int
    block_copies: int
    preempted: tuple[str, ...]
    finished: tuple[str, ...]
    expert_counts: tuple[tuple[int, ...], ...] | None
    schedule_s: float
    execute_s: float
    commit_s: float
    committed_in: int = -1
    copied_blocks: tuple[tuple[int, int], ...] = ()
    slot_counts: tuple[tuple[int, ...], ...] | None = None
    ranks: tuple[RankStats, ...] = ()

    @property
    def num_drafted(self) -> int:
        """Draft tokens verified in this step."""
        return sum(c.num_drafted for c in self.chunks)

    @property
    def num_accepted(self) -> int:
        """Draft tokens accepted in this step."""
        return sum(c.num_accepted for c in self.chunks)

    def describe(self) -> str:
        """A few human-readable lines."""
        lines = [
            f"step {self.step_id}: {self.num_batched_tokens}/{self.token_budget} tokens, "
            f"free blocks {self.free_blocks_before}->{self.free_blocks_after}, "
            f"evicted {self.blocks_evicted}, prefix hits {self.prefix_hit_tokens} tokens, "
            f"schedule {self.schedule_s * 1e3:.2f} ms, execute {self.execute_s * 1e3:.2f} ms, "
            f"commit {self.commit_s * 1e3:.2f} ms"
            + (f", committed in step {self.committed_in}" if self.committed_in != self.step_id else "")
        ]
        for c in self.chunks:
            lines.append(
                f"  {c.request_id}: {c.kind} [{c.start}, {c.start + c.num_tokens}) "
                f"cached={c.num_cached_tokens} blocks={c.num_blocks} sampled={list(c.sampled)}"
                + (f" drafted={c.num_drafted} accepted={c.num_accepted}" if c.num_drafted else "")
            )
        lines.extend(f"  {describe_rank(r)}" for r in self.ranks)
        if self.preempted:
            lines.append(f"  preempted: {', '.join(self.preempted)}")
        if self.finished:
            lines.append(f"  finished: {', '.join(self.finished)}")
        return "\n".join(lines)


def make_trace(
    plan: SchedulePlan,
    result: StepResult,
    finished: list[RequestOutput],
    free_blocks: tuple[int, int],
    blocks_evicted: int,
    times: tuple[float, float, float, float],
    committed_in: int | None = None,
) -> StepTrace:
    """The :class:`StepTrace` of one step, from its plan (snapshots only), its result and
    the outputs it finished. ``free_blocks`` is (before, after); ``times`` the
    ``perf_counter`` at the start, after scheduling, after executing, after committing;
    ``committed_in`` the newest step scheduled at the commit (default: ``plan.step_id``)."""
    chunks = []
    logprobs = result.logprobs
    planned = plan.all_chunks()  # batch order: the result's
    for i, chunk in enumerate(planned):
        sampled = result.token_ids[i] if i < len(result.token_ids) else []
        maps = logprobs[i] if logprobs is not None and i < len(logprobs) else []
        drafted = result.num_drafted[i] if i < len(result.num_drafted) else 0
        # A chunk the runner resolved (overlapped speculation) ran where it really started,
        # with the drafts it proposed in its room.
        shift = result.shifts[i] if result.shifts else 0
        num_tokens = chunk.num_tokens - chunk.draft_room + drafted if chunk.draft_room else chunk.num_tokens
        chunks.append(
            TracedChunk(
                request_id=chunk.request_id,
                kind="prefill" if chunk.is_prefill else "decode",
                start=chunk.start - shift,
                num_tokens=num_tokens,
                num_cached_tokens=chunk.num_cached_tokens,
                sampled=tuple(sampled),
                num_blocks=len(chunk.block_table),
                num_drafted=drafted,
                num_accepted=result.num_accepted[i] if i < len(result.num_accepted) else 0,
                drafted=result.drafts[i] if result.drafts else tuple(chunk.spec_token_ids),
                candidates=tuple(
                    tuple(sorted(((t, lp.logprob, lp.rank) for t, lp in m.items()), key=_by_rank))
                    for m in maps
                ),
                block_table=tuple(chunk.block_table),
                row=chunk.sampling,
                output_position=chunk.output_position - shift,
            )
        )
    counts = result.expert_counts
    t0, t1, t2, t3 = times
    unused_room = sum(c.draft_room for c in planned) - sum(
        c.num_drafted for c, p in zip(chunks, planned) if p.draft_room)
    return StepTrace(
        step_id=plan.step_id,
        chunks=tuple(chunks),
        num_batched_tokens=plan.num_batched_tokens - unused_room,  # the room the runner left undrafted ran nothing
        token_budget=plan.token_budget,
        free_blocks_before=free_blocks[0],
        free_blocks_after=free_blocks[1],
        blocks_evicted=blocks_evicted,
        prefix_hit_tokens=plan.num_cached_tokens,
        block_copies=len(plan.block_copies),
        copied_blocks=tuple((src, dst) for src, dst in plan.block_copies),
        preempted=tuple(plan.preempted_ids),
        finished=tuple(
            f"{o.request_id}#{c.index}" if c.index else o.request_id
            for o in finished
            for c in o.outputs
        ),
        expert_counts=tuple(tuple(row) for row in counts) if counts is not None else None,
        schedule_s=t1 - t0,
        execute_s=t2 - t1,
        commit_s=t3 - t2,
        committed_in=plan.step_id if committed_in is None else committed_in,
        slot_counts=tuple(tuple(r) for r in result.slot_counts) if result.slot_counts else None,
        ranks=tuple(result.ranks) if result.ranks else (),
    )


def _by_rank(entry: tuple[int, float, int]) -> tuple[int, int]:
    return entry[2], entry[0]


def token_timeline(
    traces: Sequence[StepTrace], request_id: str, output_ids: Sequence[int]
) -> list[tuple[int, int, int, int | None]]:
    """Per token the request ``request_id`` (one completion) sampled, in step order:
    ``(output index, token id, step sampled in, step committed in)``; the last is
    ``None`` for a token that was sampled but discarded (under overlap: the request had
    finished, was aborted or preempted by the time that step was committed).

    ``output_ids`` are the completion's final tokens. Of several samples of one output
    index (a step discarded by a preemption, then the recompute), the newest is the
    committed one: once an index is committed, no later step samples it again. Host
    only, O(chunks in ``traces``).
    """
    samples: list[tuple[int, int, int, int]] = []
    for t in traces:
        for c in t.chunks:
            if c.request_id != request_id or not c.sampled:
                continue
            tokens = c.sampled if c.num_drafted else c.sampled[:1]  # a fork's other rows are its children's
            samples.extend((c.output_position + k, tok, t.step_id, t.committed_in) for k, tok in enumerate(tokens))
    newest = {index: n for n, (index, *_rest) in enumerate(samples)}
    return [
        (index, tok, step, committed if index < len(output_ids) and newest[index] == n else None)
        for n, (index, tok, step, committed) in enumerate(samples)
    ]
