"""StepResult: what one executed round produced — the record the runner and the executors
hand back and the scheduler commits. Neutral ground, so overlap/ and engine/ need no sched/."""

from __future__ import annotations

import attrs

from deepinfer_kit.cache.tiers.records import TransferOutput
from deepinfer_kit.outputs import Logprob

__all__ = ["StepResult", "RankStats"]


@attrs.frozen(slots=True)
class RankStats:
    """One rank of a multi-rank model in one round (traces).

    Attributes:
        rank: the rank's global index.
        run_s: wall time the rank spent laying out and running the round.
        comm_s: of that, time inside its tensor-parallel collectives (waiting for peers
            included).
        comm_calls, comm_bytes: those collectives and the payload bytes it contributed.
        weight_bytes: bytes of the parameters this rank holds (its shard).
        kv_bytes: bytes of its KV pool.
    """

    rank: int
    run_s: float
    comm_s: float
    comm_calls: int
    comm_bytes: int
    weight_bytes: int
    kv_bytes: int


@attrs.define(slots=True, eq=False)
class StepResult:
    """What one executed round produced, aligned with the plan's batch
    (``SchedulePlan.all_chunks()``: its decode rows, then its chunk records).

    Attributes:
        token_ids: per chunk, the tokens to append: ``[]`` for a chunk with
            ``sample=False``; one token for a decode; the accepted drafts plus the
            recovered/bonus token for a verified chunk; ``num_samples`` tokens for a fork
            (token ``i`` starts completion ``i``).
        logprobs: per chunk, aligned with ``token_ids``, the logprob maps (chosen token
            plus top alternatives); ``None`` when no request asked for logprobs.
        num_drafted: per chunk, drafts verified (for traces); empty when no chunk of the
            round verified drafts.
        num_accepted: per chunk, drafts accepted (``len(token_ids[i]) - 1`` for a verified
            chunk, 0 otherwise); empty exactly when ``num_drafted`` is.
        errors: per chunk, ``None`` or why that chunk's sample is unusable (e.g. its
            logits were not finite); the scheduler ends such a request with reason
            ``error`` instead of appending ``token_ids[i]``. Empty means no errors.
        expert_counts: ``[L][E]`` tokens routed to each expert in this round, when the
            runner was asked for them (traces); ``None`` otherwise.
        slot_counts: ``[L][P]`` token copies each physical expert slot served in this
            round, when tracing an engine with EPLB on; ``None`` otherwise.
        drafts: per chunk, the drafts a runner proposed itself and verified (overlapped
            speculation, :class:`~deepinfer_kit.engine.runner.drafting.RunnerDrafting`:
            the plan carried only room for them); empty when every draft came with the
            plan (``ScheduledChunk.spec_token_ids``).
        shifts: per chunk, the positions a runner moved it down when it ran (overlapped
            speculation: the round before rejected drafts the plan assumed accepted);
            empty when no chunk moved.
        prompt_logprobs: per chunk, the maps of the prompt tokens its positions predict
            (``ScheduledChunk.prompt_targets``, in order; empty for other chunks); ``None``
            when no chunk asked.
        ranks: with a multi-rank model, every rank's :class:`RankStats` for this round,
            rank 0 first; ``None`` otherwise.
        kv_transfers: what the device side of the KV tiers finished for the round's
            ``SchedulePlan.kv_transfers`` (the scheduler hands it to the cache manager at
            commit); ``None`` when the round moved nothing.
    """

    token_ids: list[list[int]]
    logprobs: list[list[dict[int, Logprob]]] | None = None
    num_drafted: list[int] = attrs.field(factory=list)
    num_accepted: list[int] = attrs.field(factory=list)
    errors: list[str | None] = attrs.field(factory=list)
    expert_counts: list[list[int]] | None = None
    slot_counts: list[list[int]] | None = None
    prompt_logprobs: list[list[dict[int, Logprob]]] | None = None
    drafts: list[tuple[int, ...]] = attrs.field(factory=list)
    shifts: list[int] = attrs.field(factory=list)
    kv_transfers: TransferOutput | None = None
    ranks: list[RankStats] | None = None
