"""A small HTTP proxy in front of prefill and decode servers (``deepinfer-kit serve
--kv-role prefill|decode``, sharing a KV folder or joined in pairs by device links): each
completion goes to a prefill server for its prompt's KV, then to a decode server that loads
it (``deepinfer-kit pd-proxy``) — over a device link, one on the link the prefill answer
names (:class:`DecodeLinks`).

The prefill server answers once the prompt's blocks are on disk (``PromptSaves``), so the
decode server's loads find them at once; its answer's ``kv_transfer_params`` says how many
of the prompt's blocks it wrote, and the decode server waits for no others. The client's
body goes to the decode server unchanged but for ``kv_transfer_params``, and its answer (JSON or a server-sent event
stream) comes back as it is produced; a client that disconnects closes the upstream
stream, which aborts the request there. A prefill server that fails (down, 5xx) costs
only the prefill: the decode server computes the prompt itself (``load_remote: false``,
no wait); a request the prefill server refuses as the client's error (4xx) is answered
with that refusal. Needs FastAPI, uvicorn and httpx.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import attrs
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from deepinfer_kit.cache.tiers.config import is_link_id
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.serve.http import read_json
from deepinfer_kit.serve.options import ServeOptions
from deepinfer_kit.serve.responses import error_body

__all__ = ["ProxyStats", "build_proxy_app"]

_FORWARDED = ("authorization", "content-type", "accept")


@attrs.define(slots=True)
class ProxyStats:
    """Counters of a proxy (``GET /proxy/stats``).

    Attributes:
        requests: completions routed.
        prefilled: of them, prompts a prefill server computed first.
        fallbacks: of them, prompts the decode server computed because the prefill server
            failed or could not be reached.
        refused: of them, refused by the prefill server as the client's error (4xx).
    """

    requests: int = 0
    prefilled: int = 0
    fallbacks: int = 0
    refused: int = 0


def _prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The body a prefill server gets: one token, no stream, saving the prompt."""
    pre = {k: v for k, v in body.items() if k != "stream_options"}
    pre.update(max_tokens=1, stream=False, n=1, kv_transfer_params={"save_prompt": True})
    if "max_completion_tokens" in pre:
        pre["max_completion_tokens"] = 1
    return pre


def _decode_kv(prefill: httpx.Response | None) -> dict[str, Any]:
    """The decode server's ``kv_transfer_params``: load what the prefill server says it
    wrote (its answer's ``remote_blocks``; all prompt blocks when it does not say; over a
    device link, its ``remote_link``), or nothing when it failed."""
    if prefill is None:
        return {"load_remote": False}
    try:
        said = prefill.json().get("kv_transfer_params")
    except (ValueError, AttributeError):
        said = None
    if not isinstance(said, dict):
        return {"load_remote": True}
    out: dict[str, Any] = {"load_remote": True}
    blocks, link = said.get("remote_blocks"), said.get("remote_link")
    if isinstance(blocks, int) and not isinstance(blocks, bool) and blocks >= 0:
        out["remote_blocks"] = blocks
    if is_link_id(link):
        out["remote_link"] = link  # the decode server waits only when it is on that link
    return out


class DecodeLinks:
    """Which decode server a prefill answer goes to: one on the device link the answer
    names (``remote_link``; each server's links read once from its ``GET /kv_link``),
    round robin among those; else any, round robin (a shared folder, or no link named)."""

    def __init__(self, client: httpx.AsyncClient, urls: Sequence[str], rotation: Iterator[str]) -> None:
        self._client = client
        self._urls = list(urls)
        self._rotation = rotation
        self._links_of: dict[str, frozenset[str]] = {}
        self._turns: dict[str, Iterator[str]] = {}

    async def _links(self, url: str) -> frozenset[str]:
        """The links the decode server at ``url`` receives on (read once)."""
        if url not in self._links_of:
            try:
                said = (await self._client.get(url + "/kv_link")).json()
            except (httpx.HTTPError, ValueError):
                return frozenset()  # asked again next time: the server may be starting
            said = said if isinstance(said, dict) else {}
            links = [said.get("link"), *(said.get("links") or [])]
            self._links_of[url] = frozenset(x for x in links if isinstance(x, str))
        return self._links_of[url]

    async def decode_for(self, link: object) -> str:
        """The decode server for an answer naming ``link`` (``None``: any)."""
        if isinstance(link, str):
            on = [u for u in self._urls if link in await self._links(u)]
            if on:
                if link not in self._turns:
                    self._turns[link] = itertools.cycle(on)
                return next(self._turns[link])
        return next(self._rotation)


def build_proxy_app(prefill: Sequence[str], decode: Sequence[str], *, timeout_s: float = 600.0,
                    options: ServeOptions | None = None,
                    transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The proxy over ``prefill`` and ``decode`` server URLs (``http://host:port``), each
    list taken round robin. A body is read as a server reads it (``options``: its size
    and nesting limits; a body that is not a JSON object goes to a decode server, which
    answers for it).

    Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (prefill, then
    decode), ``GET /v1/models`` (the first decode server's), ``GET /health`` (200 when
    every server answers its ``/health``, else 503 naming those that do not) and
    ``GET /proxy/stats`` (:class:`ProxyStats`). ``transport``: httpx's, for tests.

    Raises:
        ConfigError: no prefill or no decode server, or a URL that is not http(s).
    """
    for name, urls in (("prefill", prefill), ("decode", decode)):
        if not urls:
            raise ConfigError(f"pd-proxy needs at least one {name} server URL, got none")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"pd-proxy {name} server URL must start with http:// or https://, got {url!r}")
    options = options if options is not None else ServeOptions()
    pre_urls, dec_urls = [u.rstrip("/") for u in prefill], [u.rstrip("/") for u in decode]
    next_pre, next_dec = itertools.cycle(pre_urls), itertools.cycle(dec_urls)
    client = httpx.AsyncClient(timeout=timeout_s, transport=transport)
    stats = ProxyStats()
    links = DecodeLinks(client, dec_urls, next_dec)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="deepinfer_kit pd-proxy", lifespan=lifespan)

    def headers(request: Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED}

    @app.exception_handler(ConfigError)
    async def refused(request: Request, exc: ConfigError) -> JSONResponse:
        status = getattr(exc, "status", 400)
        return JSONResponse(error_body(str(exc), kind=getattr(exc, "kind", "BadRequestError"),
                                       param=getattr(exc, "param", None), code=status), status_code=status)

    async def route(request: Request, path: str) -> Response:
        body = await read_json(request, options)  # 415, 413, 400 as a server answers them
        raw = json.dumps(body).encode()
        if isinstance(body, dict):
            stats.requests += 1
            try:
                pre = await client.post(next(next_pre) + path, json=_prefill_body(body), headers=headers(request))
            except httpx.HTTPError:
                pre = None
            if pre is not None and 400 <= pre.status_code < 500:
                stats.refused += 1
                return Response(pre.content, status_code=pre.status_code,
                                media_type=pre.headers.get("content-type"))
            remote = pre is not None and pre.status_code == 200
            stats.prefilled += remote
            stats.fallbacks += not remote
            kv = _decode_kv(pre if remote else None)
            raw = json.dumps({**body, "kv_transfer_params": kv}).encode()
            target = await links.decode_for(kv.get("remote_link"))
        else:
            target = next(next_dec)
        upstream = client.build_request("POST", target + path, content=raw,
                                        headers={**headers(request), "content-type": "application/json"})
        try:
            answer = await client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            return unreachable(exc)
        return StreamingResponse(answer.aiter_raw(), status_code=answer.status_code,
                                 media_type=answer.headers.get("content-type"),
                                 background=BackgroundTask(answer.aclose))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await route(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await route(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            answer = await client.get(dec_urls[0] + "/v1/models", headers=headers(request))
        except httpx.HTTPError as exc:
            return unreachable(exc)
        return Response(answer.content, status_code=answer.status_code, media_type=answer.headers.get("content-type"))

    def unreachable(exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"the decode server could not be reached: {exc}", kind="ServiceUnavailable",
                                       code=503), status_code=503)

    @app.get("/health")
    async def health() -> Response:
        down = []
        for url in [*pre_urls, *dec_urls]:
            try:
                ok = (await client.get(url + "/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                down.append(url)
        return JSONResponse({"down": down}, status_code=503 if down else 200)

    @app.get("/proxy/stats")
    async def proxy_stats() -> Response:
        return JSONResponse(attrs.asdict(stats))

    app.state.stats = stats
    return app
