"""What a served API lets one client do: the server's limits and access rules
(:class:`ServeOptions`), and the checks a request body passes before anything reads it."""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from deepinfer_kit._validators import int_at_least
from deepinfer_kit.errors import ConfigError

__all__ = ["ECHO_CHARS", "ServeOptions", "api_key_matches", "check_json_tree", "host_allowed", "short"]

ECHO_CHARS = 200
"""The most characters of a client's value an error message repeats."""


def short(value: object) -> str:
    """``repr(value)`` cut to :data:`ECHO_CHARS` characters (a ``…`` and the full length
    mark a cut), so an error never echoes a huge field back."""
    text = repr(value)
    if len(text) <= ECHO_CHARS:
        return text
    return f"{text[:ECHO_CHARS]}… ({len(text)} chars)"


def _positive_float(instance: object, attribute: attrs.Attribute[float], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{attribute.name} must be a number > 0, got {value!r}")


def _host_names(value: Iterable[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        value = value.split(",")
    return tuple(h.strip().lower() for h in value if h.strip())


@attrs.frozen
class ServeOptions:
    """The limits and access rules of one served API.

    Attributes:
        api_key: the Bearer key every ``/v1/*``, ``/tokenize`` and ``/detokenize`` call
            must send (compared in constant time); ``None`` (default): no key. ``/health``,
            ``/version`` and ``/metrics`` stay open, as in vLLM.
        trust_request_chat_template: accept a ``chat_template`` in a request body (it runs
            the client's jinja code on the server); off by default, as vLLM's
            ``--trust-request-chat-template``.
        max_body_bytes: larger bodies answer 413 (checked on ``Content-Length`` and while
            reading).
        max_json_depth: deeper JSON nesting answers 400.
        max_n: the most completions one request may ask for (``n``).
        max_prompts: the most prompts one completions request may hold.
        max_stop: the most stop strings one request may give.
        max_stop_chars: the most characters its stop strings may hold together.
        chat_template_timeout_s: a chat template rendering longer answers 400 (it runs
            off the event loop, at most ``max_concurrent_renders`` at a time).
        max_concurrent_renders: chat templates rendered at once.
        allowed_hosts: when not empty, the ``Host`` names (port left out, compared without
            case) a request may carry; any other answers 400 (``param`` ``host``): a page
            that rebinds its own name to this server's address cannot read its answers.
    """

    api_key: str | None = None
    trust_request_chat_template: bool = False
    max_body_bytes: int = attrs.field(default=8 * 2**20, validator=int_at_least(1))
    max_json_depth: int = attrs.field(default=64, validator=int_at_least(2))
    max_n: int = attrs.field(default=128, validator=int_at_least(1))
    max_prompts: int = attrs.field(default=128, validator=int_at_least(1))
    max_stop: int = attrs.field(default=32, validator=int_at_least(0))
    max_stop_chars: int = attrs.field(default=4096, validator=int_at_least(0))
    chat_template_timeout_s: float = attrs.field(default=5.0, validator=_positive_float)
    max_concurrent_renders: int = attrs.field(default=4, validator=int_at_least(1))
    allowed_hosts: tuple[str, ...] = attrs.field(default=(), converter=_host_names)

    @classmethod
    def from_env(cls, **options: Any) -> ServeOptions:
        """``ServeOptions(**options)`` with ``api_key`` taken from ``DEEPINFER_API_KEY``
        when not given (an empty variable means no key)."""
        if options.get("api_key") is None:
            options["api_key"] = os.environ.get("DEEPINFER_API_KEY") or None
        return cls(**options)


def api_key_matches(headers: Mapping[str, str], key: str) -> bool:
    """True when ``headers`` carry ``Authorization: Bearer <key>``; the comparison takes
    the same time wherever the strings differ (``hmac.compare_digest``)."""
    given = headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    ok_scheme = scheme.lower() == "bearer"
    return hmac.compare_digest(token.strip().encode(), key.encode()) and ok_scheme


def host_allowed(headers: Mapping[str, str], allowed: tuple[str, ...]) -> bool:
    """True when ``allowed`` is empty or the ``Host`` header's name (its port, and an IPv6
    address's brackets, left out) is one of ``allowed``."""
    if not allowed:
        return True
    host = headers.get("host", "").strip().lower()
    if host.startswith("["):  # [ipv6]:port
        name = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:  # name:port
        name = host.split(":", 1)[0]
    else:
        name = host
    return name in allowed


def check_json_tree(body: object, max_depth: int) -> tuple[str, str] | None:
    """The first problem of a parsed JSON body as ``(message, param)``, else ``None``:
    nesting deeper than ``max_depth``, or a string (value or key) holding a lone UTF-16
    surrogate (``"\\ud800"``: valid JSON, but no UTF-8 text). ``param`` is the top-level
    field the problem sits under. Iterative: O(size of the body)."""
    stack: list[tuple[object, int, str | None]] = [(body, 1, None)]
    while stack:
        value, depth, top = stack.pop()
        if isinstance(value, str):
            if not _is_utf8(value):
                return (f"{top or 'the body'} holds a lone surrogate (not valid Unicode text)",
                        top or "body")
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > max_depth:
            return (f"the JSON body nests deeper than {max_depth} levels", top or "body")
        if isinstance(value, dict):
            for k, v in value.items():
                where = top if top is not None else str(k)
                if not _is_utf8(k):
                    return (f"{where!r} holds a key with a lone surrogate", where)
                stack.append((v, depth + 1, where))
        else:
            stack.extend((v, depth + 1, top) for v in value)
    return None


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
