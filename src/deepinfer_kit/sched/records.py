"""Configs and records of the sched package: what runs this round, and what came back."""

from __future__ import annotations

import attrs

from deepinfer_kit._validators import int_at_least, one_of
from deepinfer_kit.outputs import Logprob
from deepinfer_kit.request import Request

__all__ = ["SchedulerConfig", "ScheduledChunk", "SchedulePlan", "StepResult"]


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
class ScheduledChunk:
    """The work of one request in one round.

    The model is fed ``num_tokens`` tokens at positions ``[start, start + num_tokens)``:
    the known tokens ``request.all_token_ids[start : start + num_tokens - len(spec_token_ids)]``
    (the trailing ``num_placeholders`` of which are not in ``all_token_ids`` yet: under
    overlap they are the tokens the step in flight is sampling, resolved on the device),
    followed by ``spec_token_ids`` (drafts verified this round).

    Attributes:
        request: the request (read-only for everyone but the scheduler).
        start: first position computed; equals ``request.num_computed_tokens`` at
            scheduling time (a prefix hit moves it past the cached tokens).
        num_tokens: ``q_i``, tokens fed this round (counts against the budget).
        sample: True when logits at the chunk's last known position are sampled (the
            chunk reaches the end of the known tokens); False for a non-final prefill chunk.
        num_samples: tokens drawn from those logits (``n`` when the request forks into
            ``n`` completions at this sample, else 1).
        spec_token_ids: draft tokens appended after the known tokens; the verifier reads
            logits at ``1 + len(spec_token_ids)`` positions.
        num_placeholders: trailing known-position tokens whose values a step still in
            flight produces.
        preemption_epoch: ``request.num_preemptions`` when the chunk was scheduled;
            ``commit`` ignores a chunk whose request was preempted since (its KV and its
            blocks were dropped, so its tokens are recomputed on resume).
    """

    request: Request
    start: int
    num_tokens: int
    sample: bool = True
    num_samples: int = 1
    spec_token_ids: list[int] = attrs.field(factory=list)
    num_placeholders: int = 0
    preemption_epoch: int = 0

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.request.request_id

    @property
    def is_prefill(self) -> bool:
        """True when the chunk computes prompt tokens (or recomputes after preemption)."""
        return self.num_tokens - len(self.spec_token_ids) > 1 or not self.sample


@attrs.define(slots=True, eq=False)
class SchedulePlan:
    """One round: who runs, how many tokens each, and what the runner must do first.

    Attributes:
        step_id: increasing round number.
        chunks: scheduled work, in the order the runner lays out the batch.
        block_copies: ``(src, dst)`` block copies (copy-on-write) to perform on the device
            before the forward.
        preempted_ids: requests preempted this round (their blocks were released).
        finished: requests that ended without running this round (aborted, or rejected
            because they can never fit); reported by the next :meth:`Scheduler.commit`.
        num_batched_tokens: ``sum q_i`` over ``chunks``.
        token_budget: ``B_t`` of this round.
        num_cached_tokens: prompt tokens served from the prefix cache for the requests
            admitted (or resumed) this round; counted at this round's match, for traces.
    """

    step_id: int
    chunks: list[ScheduledChunk] = attrs.field(factory=list)
    block_copies: list[tuple[int, int]] = attrs.field(factory=list)
    preempted_ids: list[str] = attrs.field(factory=list)
    finished: list[Request] = attrs.field(factory=list)
    num_batched_tokens: int = 0
    token_budget: int = 0
    num_cached_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        """True when nothing runs on the device this round."""
        return not self.chunks


@attrs.define(slots=True, eq=False)
class StepResult:
    """What one executed round produced, aligned with ``SchedulePlan.chunks``.

    Attributes:
        token_ids: per chunk, the tokens to append: ``[]`` for a chunk with
            ``sample=False``; one token for a decode; the accepted drafts plus the
            recovered/bonus token for a verified chunk; ``num_samples`` tokens for a fork
            (token ``i`` starts completion ``i``).
        logprobs: per chunk, aligned with ``token_ids``, the logprob maps (chosen token
            plus top alternatives); ``None`` when no request asked for logprobs.
        num_drafted: per chunk, drafts verified (for traces); empty when no speculation.
    """

    token_ids: list[list[int]]
    logprobs: list[list[dict[int, Logprob]]] | None = None
    num_drafted: list[int] = attrs.field(factory=list)
