"""What a user gets back: RequestOutput, CompletionOutput, Logprob, RequestMetrics."""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["Logprob", "CompletionOutput", "RequestMetrics", "RequestOutput"]


@attrs.frozen(slots=True)
class Logprob:
    """A token's log-probability and its rank (1 = most likely) in the model's distribution."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@attrs.define(slots=True)
class CompletionOutput:
    """One completion of a request (``index`` in ``[0, n)``).

    Attributes:
        index: which of the request's ``n`` completions this is.
        text: the decoded tokens (empty when no tokenizer is attached).
        token_ids: generated token ids, in order.
        cumulative_logprob: sum of the chosen tokens' logprobs when logprobs were asked
            for, else ``None``.
        logprobs: per generated token, a map from token id to :class:`Logprob` holding the
            chosen token and the top alternatives; ``None`` when not asked for.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"`` or ``"error"`` once finished,
            else ``None``.
        stop_reason: the stop token id that ended the completion (``None`` for EOS or when
            not stopped by a token); for ``"error"``, the error message.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finish_reason is not None


@attrs.define(slots=True)
class RequestMetrics:
    """Wall-clock times (``time.monotonic()`` seconds) of a request's life, and its
    speculative-decoding counts: drafts verified, and drafts accepted (each verify round
    also yields one target token, not counted). Mean acceptance length per verify round is
    ``1 + num_accepted_tokens / verify rounds``."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@attrs.define(slots=True)
class RequestOutput:
    """The state of one request as reported to the user.

    Attributes:
        request_id: the id given to ``add_request`` (for ``n > 1``, the parent's id).
        prompt: the prompt text when it was given as text, else ``None``.
        prompt_token_ids: the prompt's token ids.
        outputs: one :class:`CompletionOutput` per completion, sorted by ``index``.
        finished: True when every completion has a finish reason.
        num_cached_tokens: prompt tokens whose KV came from the prefix cache.
        metrics: the request's timings.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs`` set, per prompt token
            ``None`` for the first, then a map from token id to :class:`Logprob` holding the
            prompt token and the top alternatives given the tokens before it; else ``None``.
        kv_transfer_params: what a prefill server tells the decode side about the
            request's KV (``{"remote_blocks": n}``: its leading prompt blocks on disk; vLLM's
            field), set on the final output of a ``save_prompt`` request served by
            ``AsyncLLM``; else ``None``.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    kv_transfer_params: dict[str, Any] | None = None
