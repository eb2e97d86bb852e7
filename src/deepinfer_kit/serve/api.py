"""The OpenAI-compatible HTTP app (FastAPI): /v1/completions, /v1/chat/completions (JSON or
server-sent events), /v1/models, /tokenize, /detokenize, /health, /version, /metrics, over
one :class:`AsyncLLM`.

Importing this module needs the ``serve`` extra (FastAPI, prometheus_client); nothing else
imports it eagerly.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

import attrs
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.outputs import RequestOutput
from deepinfer_kit.serve.async_llm import AsyncLLM
from deepinfer_kit.serve.http import EdgeMiddleware, engine_param, read_json
from deepinfer_kit.serve.metrics import ServerMetrics
from deepinfer_kit.serve.options import ServeOptions
from deepinfer_kit.serve.protocol import BadRequest, ParsedRequest, parse_chat, parse_completion
from deepinfer_kit.serve.responses import (
    chat_choice, completion_choice, envelope, error_body, new_id, prompt_logprobs_json, usage,
)
from deepinfer_kit.serve.routes import add_info_routes, chat_renderer_call, max_model_len

__all__ = ["build_app"]

Choice = Callable[[int, Any, bool], dict[str, Any]]
T = TypeVar("T")
_FIELDS = ("max_tokens", "n", "logprobs", "top_logprobs", "prompt_logprobs", "logit_bias",
           "allowed_token_ids", "bad_words", "stop_token_ids", "stop", "truncate_prompt_tokens",
           "temperature", "top_k", "top_p", "min_p", "seed", "min_tokens", "structured_outputs",
           "prompt", "messages")


async def _merged(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index. Leaving
    early (a client gone) cancels every stream, which aborts its request."""
    queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                await queue.put((i, out))
            await queue.put((i, None))
        except Exception as exc:  # handed to the reader
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _until_disconnect(request: Request) -> None:
    """Return once the client of ``request`` has gone. Call only after its body was read:
    the server's next message is then ``http.disconnect``, sent when the client leaves
    (or when the response is complete)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """``work``'s result, or ``None`` when the client disconnects first: then ``work`` is
    cancelled (the streams it reads close, which aborts their requests and frees their
    blocks) before this returns."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None


def _sse(data: dict[str, Any]) -> str:
    # ASCII only: a raw U+0085 / U+2028 in a token's text would end the line for clients
    # that split lines the way str.splitlines does (httpx's iter_lines among them).
    return f"data: {json.dumps(data, ensure_ascii=True)}\n\n"


def _refusal(exc: Exception, fallback: str) -> BadRequest:
    """An engine-side ConfigError as a 400 naming the body field it is about."""
    if isinstance(exc, BadRequest):
        return exc
    message = str(exc)
    message = message if len(message) <= 300 else message[:300] + f"… ({len(message)} chars)"
    param = engine_param(message, _FIELDS, fallback)
    return BadRequest(message, fallback if param in ("prompt", "messages") else param)


def build_app(llm: AsyncLLM, *, model_name: str, chat_template: str | None = None,
              options: ServeOptions | None = None, sampling_defaults: Mapping[str, Any] | None = None,
              root: str | None = None) -> Any:
    """A FastAPI app serving ``llm`` under ``model_name``.

    A bad body, a malformed or over-the-cap field, or a request the engine refuses answers
    400 with an OpenAI error body whose ``param`` names the field; 401 / 413 / 415 as
    :class:`ServeOptions` and :func:`~deepinfer_kit.serve.http.read_json` say; an unknown
    model 404; an unexpected failure 500 in the same JSON shape. A request whose client
    disconnects (streaming or not) aborts its requests.

    Args:
        chat_template: the template for chat requests (else the model's).
        options: limits and access rules (default ``ServeOptions()``: no key).
        sampling_defaults: SamplingParams fields a body leaves unset (default: the
            ``LLM``'s ``generation_config.json`` fields).
        root: the model's path shown in ``/v1/models`` (default ``model_name``).
    """
    options = options if options is not None else ServeOptions()
    defaults = dict(sampling_defaults if sampling_defaults is not None else llm.llm.sampling_defaults)
    metrics = ServerMetrics(model_name)
    app = FastAPI(title="deepinfer_kit")
    app.add_middleware(EdgeMiddleware, options=options, on_status=metrics.observe_http)
    context = max_model_len(llm)
    render = chat_renderer_call(llm, options)
    add_info_routes(app, llm, model_name=model_name, root=root or model_name, options=options,
                    metrics=metrics, render=render, chat_template=chat_template)

    @app.exception_handler(ConfigError)
    async def bad_request(request: Request, exc: ConfigError) -> JSONResponse:
        bad = _refusal(exc, "messages" if "chat" in request.url.path else "prompt")
        return JSONResponse(error_body(str(bad), kind=bad.kind, param=bad.param, code=bad.status),
                            status_code=bad.status)

    @app.exception_handler(UnicodeError)
    async def bad_text(request: Request, exc: UnicodeError) -> JSONResponse:
        return JSONResponse(error_body(f"the request holds text that is not valid Unicode: "
                                       f"{str(exc)[:200]}", param="body"), status_code=400)

    @app.exception_handler(RecursionError)
    async def too_deep(request: Request, exc: RecursionError) -> JSONResponse:
        return JSONResponse(error_body("the request nests too deeply", param="body"), status_code=400)

    def check_model(parsed: ParsedRequest) -> None:
        if parsed.model is not None and parsed.model != model_name:
            raise BadRequest(f"The model `{parsed.model[:200]}` does not exist.", "model",
                             status=404, kind="NotFoundError")

    def check_prompt(prompt: str | list[int], parsed: ParsedRequest, fallback: str) -> None:
        """The engine's checks, and max_tokens against the context (vLLM answers 400)."""
        params = parsed.params
        try:
            llm.engine.check_request(prompt, params)
            ids, _ = llm.engine.encode(prompt)
        except ConfigError as exc:
            raise _refusal(exc, fallback) from None
        k = params.truncate_prompt_tokens
        n_prompt = len(ids) if k is None else min(len(ids), context - 1 if k == -1 else k)
        if params.max_tokens is not None and n_prompt + params.max_tokens > context:
            raise BadRequest(
                f"This model's maximum context length is {context} tokens. However, you requested "
                f"{n_prompt + params.max_tokens} tokens ({n_prompt} in the {fallback}, "
                f"{params.max_tokens} in the completion). Please reduce the length of the "
                f"{fallback} or completion.", "max_tokens")

    async def run(request: Request, parsed: ParsedRequest, rid: str, kind: str, choice: Choice,
                  head: Callable[[int], list[dict[str, Any]]] | None = None) -> Any:
        check_model(parsed)
        fallback = "messages" if kind == "chat.completion" else "prompt"
        for p in parsed.prompts:  # refuse bad requests before any output (400, not a stream)
            await asyncio.to_thread(check_prompt, p, parsed, fallback)
        n = parsed.params.n
        gens = [llm.generate(p, parsed.params, request_id=f"{rid}-{i}", kv=parsed.kv)
                for i, p in enumerate(parsed.prompts)]
        if not parsed.stream:
            async def collect() -> dict[int, RequestOutput]:
                finals: dict[int, RequestOutput] = {}
                async for i, out in _merged(gens):
                    finals[i] = out
                return finals

            finals = await _unless_disconnected(request, collect())
            if finals is None:  # nobody is left to read an answer
                return Response(status_code=499)
            outs = [finals[i] for i in range(len(gens))]
            for o in outs:
                metrics.observe_finished(o)
            choices = [choice(i * n + c.index, c, False) for i, o in enumerate(outs) for c in o.outputs]
            if parsed.params.prompt_logprobs is not None:
                for i, o in enumerate(outs):
                    for c in choices[i * n:(i + 1) * n]:
                        c["prompt_logprobs"] = prompt_logprobs_json(o)
            answer = {**envelope(kind, model_name, rid), "choices": choices, "usage": usage(outs)}
            kv = [o.kv_transfer_params for o in outs]
            if kv and all(k is not None for k in kv):  # a prefill server's: how much of the prompts is down
                said: dict[str, Any] = {"remote_blocks": min(int(k["remote_blocks"]) for k in kv if k)}
                links = {k.get("remote_link") for k in kv if k}
                if len(links) == 1 and None not in links:
                    said["remote_link"] = links.pop()
                answer["kv_transfer_params"] = said
            return JSONResponse(answer)

        async def events() -> AsyncIterator[str]:
            base = envelope(kind + ".chunk" if kind == "chat.completion" else kind, model_name, rid)
            prompt_tokens: dict[int, int] = {}
            lengths: dict[int, dict[int, int]] = {}
            completion_tokens = 0
            try:
                if head is not None:
                    yield _sse({**base, "choices": head(len(gens) * n)})
                async for i, out in _merged(gens):
                    prompt_tokens[i] = len(out.prompt_token_ids)
                    completion_tokens += sum(len(c.token_ids) for c in out.outputs)
                    mine = lengths.setdefault(i, {})
                    for c in out.outputs:
                        mine[c.index] = mine.get(c.index, 0) + len(c.token_ids)
                        if c.finish_reason is not None:
                            metrics.observe_reason(c.finish_reason)
                    if out.finished:
                        metrics.observe_finished(out, list(mine.values()))
                    choices = [choice(i * n + c.index, c, True) for c in out.outputs]
                    yield _sse({**base, "choices": choices})
                if parsed.include_usage:
                    p = sum(prompt_tokens.values())
                    yield _sse({**base, "choices": [], "usage": {
                        "prompt_tokens": p, "completion_tokens": completion_tokens,
                        "total_tokens": p + completion_tokens}})
            except ConfigError as exc:
                bad = _refusal(exc, fallback)
                yield _sse(error_body(str(bad), kind=bad.kind, param=bad.param, code=bad.status))
            except Exception as exc:  # the headers are gone: report in the stream
                yield _sse(error_body(str(exc)[:600], kind=type(exc).__name__, code=500))
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        parsed = parse_completion(await read_json(request, options), options, defaults)
        k = parsed.params.logprobs or 0
        offsets: dict[int, int] = {}

        def choice(index: int, c: Any, delta: bool) -> dict[str, Any]:
            body = completion_choice(index, c, k, offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + len(c.text)
            return body

        return await run(request, parsed, new_id("cmpl"), "text_completion", choice)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        parsed, arguments = parse_chat(await read_json(request, options), options, defaults)
        check_model(parsed)
        if arguments["chat_template"] is None:
            arguments["chat_template"] = chat_template
        _, ids = await render(arguments.pop("conversation"), arguments)
        parsed = attrs.evolve(parsed, prompts=[ids])
        k = parsed.params.logprobs or 0

        def choice(index: int, c: Any, delta: bool) -> dict[str, Any]:
            return chat_choice(index, c, k, delta=delta)

        def head(count: int) -> list[dict[str, Any]]:
            return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None} for i in range(count)]

        return await run(request, parsed, new_id("chatcmpl"), "chat.completion", choice, head)

    app.state.metrics = metrics
    app.state.started = time.time()
    return app
