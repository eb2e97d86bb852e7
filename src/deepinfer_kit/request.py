"""Per-request state: ids, tokens, status, computed-token count and block table."""

from __future__ import annotations

import enum
from collections.abc import Hashable
from typing import TYPE_CHECKING, Protocol

import attrs

from deepinfer_kit.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from deepinfer_kit.sample.params import SamplingParams

if TYPE_CHECKING:
    from deepinfer_kit.cache.tiers.config import KVRequestParams

__all__ = ["FinishReason", "RequestStatus", "Request", "TokenObserver", "fork_seed"]

_MASK64 = (1 << 64) - 1


def fork_seed(seed: int | None, index: int) -> int | None:
    """The seed of completion ``index`` of a request seeded with ``seed``.

    Completion 0 keeps ``seed``; the others get distinct seeds mixed by splitmix64, so
    ``n`` seeded completions differ from each other yet are reproducible. ``None`` stays
    ``None`` (unseeded).
    """
    if seed is None or index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class TokenObserver(Protocol):
    """Follows one sequence's output token by token: its text, and the stop strings that
    need it. The engine attaches one to each request it builds (``Request.observer``);
    a scheduler used alone runs without.
    """

    def on_token(self, request: Request, stop_terminated: bool) -> str | None:
        """Called by the scheduler's commit right after each token is appended to
        ``request.output_token_ids`` (and its logprob map to ``request.logprobs``, which
        the observer may replace with one whose ``decoded_token`` is filled).
        ``stop_terminated``: the token is an EOS or stop token id that already finished
        the request. Returns the stop string the output now contains, which finishes the
        request with reason ``stop``; ``None`` otherwise. Never raises for valid ids."""
        ...

    def fork(self, child: Request) -> TokenObserver:
        """An observer for fork child ``child`` of the observed request, in the state of
        this one (called when the child is spawned, before its first token)."""
        ...


class FinishReason(str, enum.Enum):
    """Why a request stopped; the value is what users see in ``finish_reason``."""

    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_tokens, or the model's / the pool's maximum length
    ABORT = "abort"  # aborted by the user
    ERROR = "error"  # rejected or failed; ``Request.error`` says why


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"  # queued, not yet holding blocks
    RUNNING = "running"  # holds blocks, scheduled in rounds
    PREEMPTED = "preempted"  # blocks taken back; recomputes from scratch when resumed
    FINISHED = "finished"  # ``finish_reason`` is set; holds no blocks once freed

    @property
    def is_finished(self) -> bool:
        """True for FINISHED."""
        return self is RequestStatus.FINISHED


_DEFAULT_PARAMS = SamplingParams()  # frozen: one instance serves every request built without


@attrs.define(slots=True, eq=False)
class Request:
    """The mutable state of one sequence (one completion) inside the engine.

    Hot bookkeeping, so not validated: build requests at the API edge from validated
    :class:`SamplingParams` and token ids. The scheduler owns ``status``,
    ``num_computed_tokens`` and ``output_token_ids``; the KV cache manager owns
    ``block_table`` and ``prefix_state``.

    Attributes:
        request_id: unique among live requests (a fork child gets ``"{parent}#{index}"``).
        prompt_token_ids: the prompt; never empty.
        params: the sampling parameters; the defaults (``SamplingParams()``) when omitted,
            e.g. for a request used only with the KV cache manager.
        arrival_time: ``time.monotonic()`` at ``add_request``; FCFS order breaks ties by it.
        eos_token_id: the model's EOS id, or ``None`` when it has none.
        priority: lower values are served first by priority policies.
        parent_id: for a fork child, the id of the request it was forked from.
        index: which of the parent's ``n`` completions this is.
        seed: the seed this sequence samples with (a child derives its own from the
            parent's), or ``None``.
        all_token_ids: prompt followed by the generated tokens (the model's input stream).
        output_token_ids: the generated tokens only.
        status, finish_reason, stop_reason, error: the lifecycle (see :class:`FinishReason`).
        num_computed_tokens: tokens of ``all_token_ids`` whose KV is written (or scheduled to
            be written by the step in flight); the next chunk starts here.
        num_cached_tokens: prompt tokens served from the prefix cache at the last admission.
        block_table: physical block ids; token ``t`` lives in ``block_table[t // P]``.
        prefix_state: opaque per-request state of the KV cache manager (e.g. block hashes).
        cache_context: what makes equal tokens mean different KV (adapter id, cache salt,
            multimodal hash); part of every prefix-cache key. ``None`` for plain text.
        num_preemptions: how many times this request was preempted.
        cumulative_logprob, logprobs: filled when ``params.logprobs`` is set.
        prompt_logprobs: with ``params.prompt_logprobs`` set, ``[None]`` then one map per
            prompt token whose logprob was committed (entry ``j`` is prompt token ``j``'s).
        metrics: the timings reported in :class:`RequestOutput`.
        observer: told of every appended token (text, stop strings); ``None`` to skip.
        kv_params: what the request does with the KV tiers (opt out of writes, save its
            prompt for a decode engine, wait for a prefill engine's blocks); ``None``: the
            engine's defaults.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = attrs.field(factory=lambda: _DEFAULT_PARAMS)
    arrival_time: float = 0.0
    eos_token_id: int | None = None
    priority: int = 0
    parent_id: str | None = None
    index: int = 0
    seed: int | None = None
    prompt_text: str | None = None
    all_token_ids: list[int] = attrs.field(factory=list)
    output_token_ids: list[int] = attrs.field(factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_table: list[int] = attrs.field(factory=list)
    prefix_state: object | None = None
    cache_context: Hashable = None
    num_preemptions: int = 0
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: RequestMetrics | None = None
    observer: TokenObserver | None = None
    kv_params: KVRequestParams | None = None

    def __attrs_post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        if self.seed is None:
            self.seed = self.params.seed
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens so far."""
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        """True once a finish reason is set."""
        return self.status is RequestStatus.FINISHED

    @property
    def is_prefill(self) -> bool:
        """True while some prompt token (or a recomputed output token) still lacks KV."""
        return self.num_computed_tokens < self.num_tokens - 1 or not self.output_token_ids

    def append_token(self, token_id: int) -> None:
        """Append one generated token (called by the scheduler's commit)."""
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """Mark the request finished; the caller frees its blocks."""
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def completion(self, text: str = "") -> CompletionOutput:
        """This sequence's state as a :class:`CompletionOutput` (copies the token list)."""
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=list(self.output_token_ids),
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason.value if self.finish_reason is not None else None,
            stop_reason=self.stop_reason,
        )

    def to_output(self, text: str = "") -> RequestOutput:
        """This sequence alone as a :class:`RequestOutput` (the engine merges fork children)."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt_text,
            prompt_token_ids=list(self.prompt_token_ids),
            outputs=[self.completion(text)],
            finished=self.is_finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics,
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
        )
