"""OpenAI request bodies to SamplingParams and prompts, and RequestOutputs to OpenAI
response and stream-chunk dicts. Pure Python: no web framework imported here."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

import attrs

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer_kit.sample.params import RequestOutputKind, SamplingParams

__all__ = ["BadRequest", "ParsedRequest", "parse_completion", "parse_chat", "completion_choice",
           "chat_choice", "usage", "envelope", "error_body", "new_id"]


class BadRequest(ConfigError):
    """A request body the server answers with 400; ``param`` names the field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@attrs.frozen
class ParsedRequest:
    """What one endpoint call asks for.

    Attributes:
        prompts: texts or token-id lists (the completions endpoint may take several).
        params: one SamplingParams for every prompt (DELTA when streaming).
        stream: answer with server-sent events.
        include_usage: a last stream chunk carrying token counts.
        model: the model name the client gave (``None``: any).
    """

    prompts: list[str | list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    model: str | None


_NUMBER = (int, float)

# (OpenAI / vLLM field, SamplingParams field, accepted types)
_SAMPLING_FIELDS: tuple[tuple[str, str, tuple[type, ...]], ...] = (
    ("temperature", "temperature", _NUMBER), ("top_p", "top_p", _NUMBER), ("top_k", "top_k", (int,)),
    ("min_p", "min_p", _NUMBER), ("n", "n", (int,)), ("seed", "seed", (int,)),
    ("presence_penalty", "presence_penalty", _NUMBER),
    ("frequency_penalty", "frequency_penalty", _NUMBER),
    ("repetition_penalty", "repetition_penalty", _NUMBER), ("ignore_eos", "ignore_eos", (bool,)),
    ("min_tokens", "min_tokens", (int,)), ("stop_token_ids", "stop_token_ids", (list,)),
    ("include_stop_str_in_output", "include_stop_str_in_output", (bool,)),
    ("skip_special_tokens", "skip_special_tokens", (bool,)),
    ("spaces_between_special_tokens", "spaces_between_special_tokens", (bool,)),
    ("truncate_prompt_tokens", "truncate_prompt_tokens", (int,)),
)
# Fields that would change the answer and are not supported: refused unless default.
_UNSUPPORTED = {"logit_bias": (None, {}), "best_of": (None, 1), "echo": (None, False),
                "suffix": (None, ""), "tools": (None, []), "response_format": (None,)}


def _field(body: Mapping[str, Any], name: str, types: tuple[type, ...], default: Any = None) -> Any:
    """``body[name]`` checked against ``types`` (``None`` means default)."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in types:
        ok = False
    else:
        ok = isinstance(value, types)
    if not ok:
        names = " or ".join("number" if t is float else t.__name__ for t in types if t is not int
                            or float not in types)
        raise BadRequest(f"{name} must be a {names}, got {value!r}", name)
    return value


def _sampling(body: Mapping[str, Any], max_tokens: int | None, logprobs: int | None,
              stream: bool) -> SamplingParams:
    kwargs: dict[str, Any] = {}
    for wire, field, types in _SAMPLING_FIELDS:
        value = _field(body, wire, types)
        if value is not None:
            kwargs[field] = value
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise BadRequest(f"stop must be a string or a list of strings, got {stop!r}", "stop")
        kwargs["stop"] = stop
    for name, allowed in _UNSUPPORTED.items():
        if name in body and body[name] not in allowed:
            raise BadRequest(f"{name} is not supported by this server, got {body[name]!r}", name)
    kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, output_kind=kind, **kwargs)
    except ConfigError as exc:
        raise BadRequest(str(exc), str(exc).split(" ", 1)[0]) from None


def _common(body: object) -> tuple[Mapping[str, Any], bool, bool, str | None]:
    if not isinstance(body, Mapping):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    stream = bool(_field(body, "stream", (bool,), False))
    options = _field(body, "stream_options", (dict,), {})
    include_usage = bool(options.get("include_usage", False)) if stream else False
    model = _field(body, "model", (str,))
    return body, stream, include_usage, model


def parse_completion(body: object) -> ParsedRequest:
    """``/v1/completions``: ``prompt`` is a text, a list of texts, token ids, or a list of
    token-id lists; ``max_tokens`` defaults to 16; ``logprobs`` is an int (top-k).

    Raises:
        BadRequest: a missing or malformed field (named in ``param``).
    """
    data, stream, include_usage, model = _common(body)
    prompt = data.get("prompt")
    prompts: list[str | list[int]]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) and not isinstance(p, bool)
                                                    for p in prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(
        isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt
    ):
        prompts = [list(p) for p in prompt]
    else:
        raise BadRequest(
            f"prompt must be a string, a list of strings, a list of token ids or a list of "
            f"token-id lists, got {prompt!r}", "prompt")
    max_tokens = _field(data, "max_tokens", (int,), 16)
    logprobs = _field(data, "logprobs", (int,))
    return ParsedRequest(prompts, _sampling(data, max_tokens, logprobs, stream), stream,
                         include_usage, model)


def parse_chat(body: object) -> tuple[ParsedRequest, dict[str, Any]]:
    """``/v1/chat/completions``: the sampling request (prompts left empty: the caller
    renders ``messages``) and the template arguments (messages, chat_template,
    add_generation_prompt, continue_final_message, chat_template_kwargs).

    ``max_completion_tokens`` (or ``max_tokens``) defaults to ``None``: until the context
    is full; ``logprobs`` is a bool and ``top_logprobs`` the count.

    Raises:
        BadRequest: a missing or malformed field (named in ``param``).
    """
    data, stream, include_usage, model = _common(body)
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise BadRequest(f"messages must be a non-empty list of message objects, got {messages!r}",
                         "messages")
    max_tokens = _field(data, "max_completion_tokens", (int,)) or _field(data, "max_tokens", (int,))
    want = _field(data, "logprobs", (bool,), False)
    top = _field(data, "top_logprobs", (int,), 0)
    template = {
        "conversation": messages,
        "chat_template": _field(data, "chat_template", (str,)),
        "add_generation_prompt": _field(data, "add_generation_prompt", (bool,), True),
        "continue_final_message": _field(data, "continue_final_message", (bool,), False),
        "chat_template_kwargs": _field(data, "chat_template_kwargs", (dict,)),
    }
    params = _sampling(data, max_tokens, top if want else None, stream)
    return ParsedRequest([], params, stream, include_usage, model), template


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
