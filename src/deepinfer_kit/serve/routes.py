"""The server's informational routes (/health, /version, /metrics, /v1/models, /tokenize,
/detokenize) and the chat-template call every chat request goes through: off the event
loop, a bounded number at a time, within a time limit."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from deepinfer_kit.cache.tiers.manager import tiered
from deepinfer_kit.serve.async_llm import AsyncLLM
from deepinfer_kit.serve.http import read_json
from deepinfer_kit.serve.kv_events import KVEventFeed
from deepinfer_kit.serve.metrics import CONTENT_TYPE, ServerMetrics
from deepinfer_kit.serve.options import ServeOptions, short
from deepinfer_kit.serve.protocol import BadRequest
from deepinfer_kit.serve.responses import error_body

__all__ = ["add_info_routes", "chat_renderer_call", "max_model_len"]

Render = Callable[[object, dict[str, Any]], Awaitable[tuple[str, list[int]]]]


def max_model_len(llm: AsyncLLM) -> int:
    """The engine's context length (prompt + output tokens of one request)."""
    sched: Any = llm.engine.scheduler
    return int(sched.config.max_model_len)


def chat_renderer_call(llm: AsyncLLM, options: ServeOptions) -> Render:
    """``await render(conversation, arguments) -> (text, ids)``: the chat template run
    on a thread, at most ``options.max_concurrent_renders`` threads at once (a slot is
    held until its thread really ends), waiting and rendering together within
    ``options.chat_template_timeout_s``.

    The returned call raises BadRequest (400, ``param`` ``chat_template``) past the time
    limit; the thread of a render that overran still runs to its end, holding its slot,
    so runaway templates can occupy the slots but never the event loop.
    """
    renderer = llm.chat_renderer
    slots: list[asyncio.Semaphore] = []  # made on the serving loop, at its first use

    async def render(conversation: object, arguments: dict[str, Any]) -> tuple[str, list[int]]:
        loop = asyncio.get_running_loop()
        if not slots:
            slots.append(asyncio.Semaphore(options.max_concurrent_renders))
        slot = slots[0]
        done: asyncio.Future[tuple[str, list[int]]] = loop.create_future()

        def work() -> None:
            try:
                result = renderer.render(conversation, "messages", **arguments)
                loop.call_soon_threadsafe(_settle, done, result, None)
            except BaseException as exc:  # handed to the awaiting request
                loop.call_soon_threadsafe(_settle, done, None, exc)
            finally:
                loop.call_soon_threadsafe(slot.release)  # only when the thread really ends

        async def start() -> tuple[str, list[int]]:
            await slot.acquire()
            try:
                threading.Thread(target=work, name="deepinfer-chat-template", daemon=True).start()
            except BaseException:
                slot.release()
                raise
            return await done

        try:
            return await asyncio.wait_for(start(), options.chat_template_timeout_s)
        except TimeoutError:
            raise BadRequest(f"rendering the chat template took longer than "
                             f"{options.chat_template_timeout_s} s", "chat_template") from None

    return render


def _settle(fut: asyncio.Future[tuple[str, list[int]]], result: tuple[str, list[int]] | None,
            exc: BaseException | None) -> None:
    if fut.done():  # the request gave up (timeout, disconnect)
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        assert result is not None
        fut.set_result(result)


def _permission(created: int) -> dict[str, Any]:
    return {"id": f"modelperm-{created}", "object": "model_permission", "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
            "organization": "*", "group": None, "is_blocking": False}


def add_info_routes(app: FastAPI, llm: AsyncLLM, *, model_name: str, root: str, options: ServeOptions,
                    metrics: ServerMetrics, render: Render, chat_template: str | None) -> None:
    """Register /health, /version, /metrics, /v1/models, /v1/kv_events, /kv_link, /tokenize and
    /detokenize on ``app``."""
    from deepinfer_kit import __version__

    created = int(time.time())
    context = max_model_len(llm)

    @app.get("/health")
    async def health() -> Response:
        # Read without a trip to the engine thread: answers at once even mid-round.
        sched: Any = llm.engine.scheduler
        alive = llm.is_running
        body = {"status": "ok" if alive else "unavailable", "engine": "alive" if alive else "dead",
                "running": sched.num_running, "waiting": sched.num_waiting,
                "engine_steps": llm.step_times.count}
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def scrape() -> Response:
        return Response(await metrics.render(llm), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "deepinfer_kit",
            "root": root, "parent": None, "max_model_len": context,
            "permission": [_permission(created)]}]}

    feed = KVEventFeed()

    @app.get("/v1/kv_events")
    async def kv_events(request: Request) -> Response:
        """The KV tiers' events after cursor ``after`` (:class:`KVEventFeed`), for routers
        that send a prompt where most of it is cached (``PrefixRouterView.apply_feed``)."""
        raw = request.query_params.get("after", "0")
        after = int(raw) if raw.isdigit() and len(raw) < 20 else -1
        if after < 0:
            raise BadRequest(f"after must be an event number >= 0, got {short(raw)}", "after")
        take = getattr(tiered(llm.engine.cache), "take_kv_events", None)
        if take is None:
            return JSONResponse(error_body("this server has no kv_tiers: it publishes no KV events",
                                           kind="NotFoundError", code=404), status_code=404)
        feed.extend(await llm.call(take))
        return JSONResponse({**feed.since(after), "block_size": llm.engine.cache.block_size})

    @app.get("/kv_link")
    async def kv_link() -> dict[str, Any]:
        """This server's part in a prefill/decode pair and the id of its device link
        (``serve --kv-link``; ``None`` without one), and for a decode server every link it
        receives on (one per prefill server): a proxy sends a prefill answer naming a link
        to a decode server on it."""
        cache = tiered(llm.engine.cache)
        connector = cache.connector if cache is not None else None
        link = getattr(connector, "link_id", None)
        links = getattr(connector, "accepts", {}) if llm.kv_role == "decode" else {}
        return {"role": llm.kv_role, "link": link if isinstance(link, str) else None,
                "links": sorted(links) if isinstance(links, dict) else []}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await read_json(request, options)
        if not isinstance(body, Mapping):
            raise BadRequest("the request body must be a JSON object", "body")
        if "messages" in body:
            template = body.get("chat_template")
            if template is not None and not options.trust_request_chat_template:
                raise BadRequest("chat_template in a request is refused: the server was not started "
                                 "with --trust-request-chat-template", "chat_template")
            args = {"chat_template": template if template is not None else chat_template,
                    "add_generation_prompt": bool(body.get("add_generation_prompt", True))}
            _, ids = await render(body["messages"], args)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str) or not prompt:
                raise BadRequest(f"prompt must be a non-empty string, got {short(prompt)}", "prompt")
            ids, _ = await asyncio.to_thread(llm.engine.encode, prompt)
        return {"count": len(ids), "max_model_len": context, "tokens": ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await read_json(request, options)
        tokens = body.get("tokens") if isinstance(body, Mapping) else None
        vocab = llm.engine.vocab_size
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens
        ):
            raise BadRequest(f"tokens must be a list of token ids in [0, {vocab}), got {short(tokens)}",
                             "tokens")
        tokenizer = llm.engine.tokenizer
        if tokenizer is None:
            raise BadRequest("this engine has no tokenizer", "tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, tokens)}
