"""The HTTP edge of the server: the API-key check, reading a JSON body within the limits
(415 / 413 / 400 before anything parses it), the access log, and the catch-all that turns an
unexpected exception into the JSON error shape."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.requests import Request

from deepinfer_kit.serve.options import ServeOptions, api_key_matches, check_json_tree, host_allowed
from deepinfer_kit.serve.protocol import BadRequest
from deepinfer_kit.serve.responses import error_body

__all__ = ["EdgeMiddleware", "read_json", "engine_param"]

access_log = logging.getLogger("deepinfer_kit.serve.access")
log = logging.getLogger("deepinfer_kit.serve")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_KEYED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
_INLINE_PARSE_BYTES = 256 * 1024


async def read_json(request: Request, options: ServeOptions) -> object:
    """The request's body parsed as JSON, after the checks that come before parsing.

    Raises:
        BadRequest: 415 when ``Content-Type`` is not ``application/json`` (a cross-site
            ``text/plain`` POST is never parsed); 413 when the body is larger than
            ``options.max_body_bytes`` (refused on ``Content-Length`` before reading, or
            while reading); 400 for invalid JSON, nesting deeper than
            ``options.max_json_depth`` or a string with a lone surrogate (``param`` names
            the top-level field).
    """
    ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if ctype != "application/json":
        raise BadRequest(f"Content-Type must be application/json, got {ctype[:80]!r}",
                         "content-type", status=415, kind="UnsupportedMediaType")
    limit = options.max_body_bytes
    too_big = BadRequest(f"the request body is larger than this server's {limit} bytes", "body",
                         status=413, kind="PayloadTooLarge")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    raw = b"".join(chunks)
    if size > _INLINE_PARSE_BYTES:  # a large body is parsed off the event loop
        return await asyncio.to_thread(_parse, raw, options.max_json_depth)
    return _parse(raw, options.max_json_depth)


def _parse(raw: bytes, max_depth: int) -> object:
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BadRequest(f"the JSON body nests deeper than {max_depth} levels", "body") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {str(exc)[:200]}", "body") from None
    problem = check_json_tree(body, max_depth)
    if problem is not None:
        raise BadRequest(problem[0], problem[1])
    return body


def engine_param(message: str, fields: tuple[str, ...], fallback: str) -> str:
    """The body field an engine refusal is about: the one of ``fields`` named earliest in
    ``message`` (as a whole word), else ``fallback`` (the prompt or messages)."""
    best, where = fallback, len(message) + 1
    for name in fields:
        m = re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", message)
        if m is not None and m.start() < where:
            best, where = name, m.start()
    return best


class EdgeMiddleware:
    """ASGI middleware around the app: refuses a ``Host`` outside
    ``options.allowed_hosts`` (400 JSON, when the list is set), refuses ``/v1/*``, ``/tokenize`` and
    ``/detokenize`` without the API key (401 JSON), writes one access-log line per request
    (``aborted`` when the client left before the answer was complete), counts statuses,
    and answers an unexpected exception with the JSON error shape (500, traceback logged)
    when the headers are not sent yet.

    Args:
        app: the wrapped ASGI app.
        options: the server's options (``api_key``).
        on_status: called with each answered request's status (metrics), or ``None``.
    """

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], *,
                 options: ServeOptions, on_status: Callable[[int], None] | None = None) -> None:
        self.app = app
        self.options = options
        self.on_status = on_status

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Handle one ASGI connection scope."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        seen: dict[str, Any] = {"status": None, "done": False}

        async def tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                seen["done"] = True
            await send(message)

        try:
            key = self.options.api_key
            path = str(scope.get("path", ""))
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            if not host_allowed(headers, self.options.allowed_hosts):
                await _send_json(tracked, 400, error_body(
                    f"Host {headers.get('host', '')[:100]!r} is not allowed on this server",
                    param="host"))
            elif key is not None and path.startswith(_KEYED_PREFIXES) and not api_key_matches(
                headers, key
            ):
                await _send_json(tracked, 401, error_body(
                    "a valid API key is required: Authorization: Bearer <key>",
                    kind="AuthenticationError", code=401))
            else:
                await self.app(scope, receive, tracked)
        except Exception:  # the catch-all: never a plain-text 500
            log.exception("unhandled error answering %s %s", scope.get("method"), scope.get("path"))
            if seen["status"] is None:
                await _send_json(tracked, 500, error_body(
                    "internal server error (logged on the server)", kind="InternalServerError",
                    code=500))
        finally:
            status = seen["status"]
            aborted = not seen["done"] or status == 499
            client = scope.get("client") or ("-", 0)
            access_log.info('%s:%s "%s %s" %s %.1fms%s', client[0], client[1], scope.get("method"),
                            scope.get("path"), status if status is not None else "-",
                            (time.perf_counter() - t0) * 1e3, " aborted" if aborted else "")
            if self.on_status is not None:
                self.on_status(499 if aborted and status == 200 else (status or 499))


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
