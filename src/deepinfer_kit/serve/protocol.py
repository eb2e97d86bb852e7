"""OpenAI request bodies to SamplingParams and prompts, under the server's per-request caps.
Pure Python: no web framework imported here. (The response side is serve/responses.py.)"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import attrs

from deepinfer_kit.cache.tiers.config import KVRequestParams
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sample.params import RequestOutputKind, SamplingParams
from deepinfer_kit.serve.options import ServeOptions, short
from deepinfer_kit.serve.structured_fields import structured_from_body
from deepinfer_kit.serve.responses import (
    chat_choice, chat_logprobs, completion_choice, completion_logprobs, envelope, error_body, new_id,
    usage,
)

__all__ = ["BadRequest", "ParsedRequest", "parse_completion", "parse_chat", "completion_choice",
           "chat_choice", "chat_logprobs", "completion_logprobs", "usage", "envelope", "error_body",
           "new_id"]

log = logging.getLogger("deepinfer_kit.serve")


class BadRequest(ConfigError):
    """A request the server refuses; ``param`` names the field at fault, ``status`` is the
    HTTP status (400 unless said otherwise: 401, 404, 413, 415)."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.kind = kind


@attrs.frozen
class ParsedRequest:
    """What one endpoint call asks for.

    Attributes:
        prompts: texts or token-id lists (the completions endpoint may take several).
        params: one SamplingParams for every prompt (DELTA when streaming).
        stream: answer with server-sent events.
        include_usage: a last stream chunk carrying token counts.
        model: the model name the client gave (``None``: any).
        kv: ``kv_transfer_params`` (vLLM's field): the request's KV tier parameters
            (``write``, ``save_prompt``, ``load_remote``); ``None``: the server's default.
    """

    prompts: list[str | list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    model: str | None
    kv: KVRequestParams | None = None


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
    ("allowed_token_ids", "allowed_token_ids", (list,)), ("bad_words", "bad_words", (list,)),
    ("prompt_logprobs", "prompt_logprobs", (int,)),
)
# Fields that would change the answer and are not supported: refused unless default.
_UNSUPPORTED = {"best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
                "tools": (None, []), "tool_choice": (None, "none"),
                "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
                "guided_grammar": (None,), "guided_decoding_backend": (None,),
                "logits_processors": (None,), "use_beam_search": (None, False),
                "lora_request": (None,), "prompt_embeds": (None,)}
# Fields read elsewhere (or harmless: metadata); anything else is logged as ignored (vLLM).
_KNOWN = {"model", "prompt", "messages", "stream", "stream_options", "max_tokens",
          "max_completion_tokens", "logprobs", "top_logprobs", "stop", "logit_bias", "user",
          "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
          "request_id", "priority", "add_special_tokens", "documents", "parallel_tool_calls",
          "metadata", "store", "service_tier", "response_format", "structured_outputs",
          "kv_transfer_params"}


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
        raise BadRequest(f"{name} must be a {names}, got {short(value)}", name)
    return value


def _logit_bias(body: Mapping[str, Any]) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token id as a string -> bias), biases clamped to
    ``[-100, 100]`` as vLLM clamps them."""
    raw = body.get("logit_bias")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise BadRequest(f"logit_bias must be an object of token id -> bias, got {short(raw)}",
                         "logit_bias")
    bias: dict[int, float] = {}
    for key, value in raw.items():
        try:
            token = int(key)
        except ValueError:
            raise BadRequest(f"logit_bias keys must be token ids, got {short(key)}", "logit_bias") from None
        if isinstance(value, bool) or not isinstance(value, _NUMBER):
            raise BadRequest(f"logit_bias[{short(key)}] must be a number, got {short(value)}",
                             "logit_bias")
        bias[token] = min(100.0, max(-100.0, float(value)))
    return bias


def _stop(body: Mapping[str, Any], options: ServeOptions) -> list[str] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest(f"stop must be a string or a list of strings, got {short(stop)}", "stop")
    if len(stop) > options.max_stop:
        raise BadRequest(f"stop holds {len(stop)} strings, more than this server's "
                         f"{options.max_stop}", "stop")
    chars = sum(len(s) for s in stop)
    if chars > options.max_stop_chars:
        raise BadRequest(f"stop strings hold {chars} characters, more than this server's "
                         f"{options.max_stop_chars}", "stop")
    return stop


def _sampling(body: Mapping[str, Any], max_tokens: int | None, logprobs: int | None,
              stream: bool, options: ServeOptions, defaults: Mapping[str, Any]) -> SamplingParams:
    kwargs: dict[str, Any] = {k: v for k, v in defaults.items() if k != "max_tokens"}
    for wire, field, types in _SAMPLING_FIELDS:
        value = _field(body, wire, types)
        if value is not None:
            kwargs[field] = value
    for name, allowed in _UNSUPPORTED.items():
        if name in body and body[name] not in allowed:
            raise BadRequest(f"{name} is not supported by this server, got {short(body[name])}", name)
    ignored = sorted(k for k in body if k not in _KNOWN and k not in _UNSUPPORTED
                     and not any(k == wire for wire, _, _ in _SAMPLING_FIELDS))
    if ignored:  # vLLM's behaviour: accepted, logged (OpenAI's API would refuse them)
        log.warning("the request's fields %s are not known and were ignored", short(ignored))
    if kwargs.get("n", 1) > options.max_n:
        raise BadRequest(f"n must be <= {options.max_n} on this server, got {kwargs['n']}", "n")
    if stream and kwargs.get("prompt_logprobs") is not None:
        raise BadRequest("prompt_logprobs is not supported with stream=true", "prompt_logprobs")
    kwargs["stop"] = _stop(body, options)
    kwargs["logit_bias"] = _logit_bias(body)
    kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    try:
        kwargs["structured_outputs"] = structured_from_body(body)
    except ConfigError as exc:
        field = "response_format" if str(exc).startswith("response_format") else "structured_outputs"
        raise BadRequest(_cut(str(exc)), field) from None
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, output_kind=kind, **kwargs)
    except ConfigError as exc:
        field = str(exc).split(" ", 1)[0].split("[", 1)[0]
        raise BadRequest(_cut(str(exc)), field) from None


def _kv(body: Mapping[str, Any]) -> KVRequestParams | None:
    """``kv_transfer_params`` as KV tier parameters (``None`` when absent)."""
    value = _field(body, "kv_transfer_params", (dict,))
    try:
        return KVRequestParams.coerce(value)
    except ConfigError as exc:
        raise BadRequest(f"kv_transfer_params: {_cut(str(exc))}", "kv_transfer_params") from None


def _cut(message: str) -> str:
    """An engine message cut to a bounded length (it may quote a client's value)."""
    return message if len(message) <= 600 else message[:600] + f"… ({len(message)} chars)"


def _common(body: object) -> tuple[Mapping[str, Any], bool, bool, str | None]:
    if not isinstance(body, Mapping):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}", "body")
    stream = bool(_field(body, "stream", (bool,), False))
    options = _field(body, "stream_options", (dict,), {})
    include_usage = bool(options.get("include_usage", False)) if stream else False
    model = _field(body, "model", (str,))
    return body, stream, include_usage, model


def _prompts(prompt: object) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) and not isinstance(p, bool)
                                                  for p in prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(
        isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
        for p in prompt
    ):
        return [list(p) for p in prompt]
    raise BadRequest(
        f"prompt must be a string, a list of strings, a list of token ids or a list of "
        f"token-id lists, got {short(prompt)}", "prompt")


def parse_completion(body: object, options: ServeOptions | None = None,
                     defaults: Mapping[str, Any] | None = None) -> ParsedRequest:
    """``/v1/completions``: ``prompt`` is a text, a list of texts, token ids, or a list of
    token-id lists; ``max_tokens`` defaults to 16 (or ``generation_config.json``'s
    ``max_new_tokens``); ``logprobs`` is an int (top-k).

    Args:
        options: the server's caps (default ``ServeOptions()``).
        defaults: SamplingParams fields a body does not set (``generation_config.json``).

    Raises:
        BadRequest: a missing, malformed or over-the-cap field (named in ``param``).
    """
    options = options if options is not None else ServeOptions()
    defaults = defaults or {}
    data, stream, include_usage, model = _common(body)
    prompts = _prompts(data.get("prompt"))
    if len(prompts) > options.max_prompts:
        raise BadRequest(f"prompt holds {len(prompts)} prompts, more than this server's "
                         f"{options.max_prompts} per request", "prompt")
    max_tokens = _field(data, "max_tokens", (int,), defaults.get("max_tokens", 16))
    logprobs = _field(data, "logprobs", (int,))
    return ParsedRequest(prompts, _sampling(data, max_tokens, logprobs, stream, options, defaults),
                         stream, include_usage, model, _kv(data))


def parse_chat(body: object, options: ServeOptions | None = None,
               defaults: Mapping[str, Any] | None = None) -> tuple[ParsedRequest, dict[str, Any]]:
    """``/v1/chat/completions``: the sampling request (prompts left empty: the caller
    renders ``messages``) and the template arguments (messages, chat_template,
    add_generation_prompt, continue_final_message, chat_template_kwargs).

    ``max_completion_tokens`` (or ``max_tokens``) defaults to ``generation_config.json``'s
    ``max_new_tokens``, else ``None``: until the context is full; ``logprobs`` is a bool
    and ``top_logprobs`` the count. A ``chat_template`` in the body is refused unless
    ``options.trust_request_chat_template``.

    Raises:
        BadRequest: a missing, malformed or refused field (named in ``param``).
    """
    options = options if options is not None else ServeOptions()
    defaults = defaults or {}
    data, stream, include_usage, model = _common(body)
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise BadRequest(f"messages must be a non-empty list of message objects, got {short(messages)}",
                         "messages")
    max_tokens = (_field(data, "max_completion_tokens", (int,)) or _field(data, "max_tokens", (int,))
                  or defaults.get("max_tokens"))
    want = _field(data, "logprobs", (bool,), False)
    top = _field(data, "top_logprobs", (int,), 0)
    template = _field(data, "chat_template", (str,))
    if template is not None and not options.trust_request_chat_template:
        raise BadRequest("chat_template in a request is refused: the server was not started with "
                         "--trust-request-chat-template", "chat_template")
    arguments = {
        "conversation": messages,
        "chat_template": template,
        "add_generation_prompt": _field(data, "add_generation_prompt", (bool,), True),
        "continue_final_message": _field(data, "continue_final_message", (bool,), False),
        "chat_template_kwargs": _field(data, "chat_template_kwargs", (dict,)),
    }
    if data.get("prompt_logprobs") is not None:
        raise BadRequest("prompt_logprobs is supported by /v1/completions only", "prompt_logprobs")
    params = _sampling(data, max_tokens, top if want else None, stream, options, defaults)
    return ParsedRequest([], params, stream, include_usage, model, _kv(data)), arguments
