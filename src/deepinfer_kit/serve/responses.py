"""RequestOutputs to OpenAI response and stream-chunk dicts, and the error body. Pure Python:
no web framework imported here."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

from deepinfer_kit.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = ["completion_choice", "chat_choice", "completion_logprobs", "chat_logprobs",
           "prompt_logprobs_json", "usage", "envelope", "error_body", "new_id"]


def _top(entry: Mapping[int, Logprob], k: int) -> list[tuple[str, float]]:
    """The ``k`` most likely tokens of one position (the entry also holds the chosen one);
    ``k = -1``: all of them (the whole vocabulary was asked for)."""
    ranked = sorted((lp for lp in entry.values() if k < 0 or lp.rank <= k), key=lambda x: x.rank)
    return [(lp.decoded_token or "", lp.logprob) for lp in ranked]


def completion_logprobs(c: CompletionOutput, offset: int, k: int) -> dict[str, Any] | None:
    """The legacy completions ``logprobs`` object of a completion's (new) tokens."""
    if c.logprobs is None:
        return None
    tokens, values, tops, offsets = [], [], [], []
    for tok, entry in zip(c.token_ids, c.logprobs):
        chosen = entry.get(tok)
        text = chosen.decoded_token if chosen is not None and chosen.decoded_token else ""
        tokens.append(text)
        values.append(chosen.logprob if chosen is not None else None)
        tops.append(dict(_top(entry, k)))
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(c: CompletionOutput, k: int) -> dict[str, Any] | None:
    """The chat ``logprobs`` object (``{"content": [...]}``) of a completion's (new) tokens."""
    if c.logprobs is None:
        return None
    content = []
    for tok, entry in zip(c.token_ids, c.logprobs):
        chosen = entry.get(tok)
        text = chosen.decoded_token if chosen is not None and chosen.decoded_token else ""
        content.append({
            "token": text, "logprob": chosen.logprob if chosen is not None else None,
            "bytes": list(text.encode()),
            "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                             for t, v in _top(entry, k)],
        })
    return {"content": content}


def prompt_logprobs_json(out: RequestOutput) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs`` of a completions choice: ``None`` for the first prompt
    token, then ``{token id (str): {"logprob", "rank", "decoded_token"}}`` per token."""
    if out.prompt_logprobs is None:
        return None
    return [None if entry is None else {
        str(tok): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
        for tok, lp in entry.items()} for entry in out.prompt_logprobs]


def completion_choice(index: int, c: CompletionOutput, k: int, offset: int = 0) -> dict[str, Any]:
    """One ``choices`` entry of a completion (or a stream chunk's delta of it); ``k`` top
    logprobs per token, ``offset`` the text offset of its first token."""
    return {"index": index, "text": c.text, "logprobs": completion_logprobs(c, offset, k),
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}


def chat_choice(index: int, c: CompletionOutput, k: int, *, delta: bool) -> dict[str, Any]:
    """One ``choices`` entry of a chat completion, or of a chunk (``delta``: the new text;
    the role went in the stream's first chunk); ``k`` top logprobs per token."""
    body: dict[str, Any] = {"index": index, "logprobs": chat_logprobs(c, k),
                            "finish_reason": c.finish_reason}
    if delta:
        body["delta"] = {"content": c.text} if c.text else {}
    else:
        body["message"] = {"role": "assistant", "content": c.text}
        body["stop_reason"] = c.stop_reason
    return body


def usage(outputs: list[RequestOutput]) -> dict[str, int]:
    """Token counts of finished requests (``outputs`` cumulative)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def envelope(kind: str, model: str, request_id: str, created: int | None = None) -> dict[str, Any]:
    """The ``id`` / ``object`` / ``created`` / ``model`` fields shared by a response and
    every chunk of its stream."""
    return {"id": request_id, "object": kind, "created": created if created is not None else int(time.time()),
            "model": model}


def new_id(prefix: str) -> str:
    """A fresh response id (``cmpl-…``, ``chatcmpl-…``)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def error_body(message: str, *, kind: str = "BadRequestError", param: str | None = None,
               code: int = 400) -> dict[str, Any]:
    """An OpenAI-style error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
