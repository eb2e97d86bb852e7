"""Per-sequence stop rules and token appending, shared by every scheduler's commit."""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer_kit.outputs import Logprob
from deepinfer_kit.request import FinishReason, Request

__all__ = ["length_limit", "check_stop", "append_token", "append_tokens"]


def length_limit(request: Request, max_model_len: int) -> int:
    """The one length rule: the total token count (prompt plus outputs) at which
    ``request`` ends with :attr:`FinishReason.LENGTH` — ``max_tokens`` outputs or
    ``max_model_len`` tokens, whichever comes first (``max_tokens=None``: the latter). Its KV never needs more than
    ``length_limit - 1`` positions (the last token is sampled, never fed). O(1)."""
    max_tokens = request.params.max_tokens
    if max_tokens is None:
        return max_model_len
    return min(len(request.prompt_token_ids) + max_tokens, max_model_len)


def check_stop(request: Request, token: int, max_model_len: int) -> bool:
    """Finish ``request`` if ``token`` (just appended as its last output) ends it.

    Rules, in order: an EOS (``request.eos_token_id``, unless ``ignore_eos``) or a
    ``stop_token_ids`` token ends it with :attr:`FinishReason.STOP` (``stop_reason`` the
    stop token id; ``None`` for EOS), but only once more than ``min_tokens`` tokens were
    generated (the sampler masks them before; this keeps the rule even if it did not).
    Then the request's ``observer`` (when set) sees the token and may report a stop
    string the text now contains: :attr:`FinishReason.STOP` with the string as
    ``stop_reason``. Then reaching :func:`length_limit` ends it with
    :attr:`FinishReason.LENGTH`. A stop token or string at the last allowed position
    counts as STOP.

    Mutates ``status``/``finish_reason``/``stop_reason`` when it finishes. O(len(stop ids)).

    Returns:
        True when the request finished.
    """
    params = request.params
    num_out = len(request.output_token_ids)
    observer = request.observer
    if num_out > params.min_tokens:
        eos = token == request.eos_token_id and not params.ignore_eos
        if eos or token in params.stop_token_ids:
            request.finish(FinishReason.STOP, None if eos else token)
            if observer is not None:
                observer.on_token(request, True)
            return True
    if observer is not None:
        stop = observer.on_token(request, False)
        if stop is not None:
            request.finish(FinishReason.STOP, stop)
            return True
    # length_limit, spelled out: this runs once per generated token.
    num_tokens = len(request.all_token_ids)
    max_tokens = params.max_tokens
    if num_tokens >= max_model_len or (
        max_tokens is not None and num_tokens >= len(request.prompt_token_ids) + max_tokens
    ):
        request.finish(FinishReason.LENGTH)
        return True
    return False


def append_token(
    request: Request, token: int, logprob: dict[int, Logprob] | None, max_model_len: int
) -> bool:
    """Append one sampled token (and its logprob map when the request asked for them),
    then apply :func:`check_stop`. Returns True when the request finished."""
    request.all_token_ids.append(token)  # Request.append_token, without the call
    request.output_token_ids.append(token)
    if logprob is not None and request.logprobs is not None:
        request.logprobs.append(logprob)
        chosen = logprob.get(token)
        if chosen is not None:
            request.cumulative_logprob += chosen.logprob
    return check_stop(request, token, max_model_len)


def append_tokens(
    request: Request,
    tokens: Sequence[int],
    logprobs: Sequence[dict[int, Logprob]] | None,
    max_model_len: int,
) -> int:
    """Append ``tokens`` in order, stopping at the first that finishes the request (the
    rest are dropped). Returns how many were appended."""
    for i, token in enumerate(tokens):
        if append_token(request, token, logprobs[i] if logprobs else None, max_model_len):
            return i + 1
    return len(tokens)
