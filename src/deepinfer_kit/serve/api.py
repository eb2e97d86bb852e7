"""The OpenAI-compatible HTTP app (FastAPI): /v1/completions, /v1/chat/completions (JSON or
server-sent events), /v1/models, /health, over one :class:`AsyncLLM`.

Importing this module needs the ``serve`` extra (FastAPI); nothing else imports it eagerly.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.outputs import RequestOutput
from deepinfer_kit.serve.async_llm import AsyncLLM
from deepinfer_kit.serve.protocol import (
    BadRequest, ParsedRequest, chat_choice, completion_choice, envelope, error_body, new_id,
    parse_chat, parse_completion, usage,
)

__all__ = ["build_app"]

Choice = Callable[[int, Any, bool], dict[str, Any]]
T = TypeVar("T")


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
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def build_app(llm: AsyncLLM, *, model_name: str, chat_template: str | None = None) -> Any:
    """A FastAPI app serving ``llm`` under ``model_name``.

    Bad JSON, a malformed field, or a request the engine refuses (prompt too long, ids out
    of the vocabulary…) answers 400 with an OpenAI error body naming the field; an unknown
    model 404. A request whose client disconnects (streaming or not) aborts its requests.

    Args:
        chat_template: the template for chat requests that give none (else the model's).

    """
    app = FastAPI(title="deepinfer_kit")
    created = int(time.time())

    @app.exception_handler(ConfigError)
    async def bad_request(request: Request, exc: ConfigError) -> JSONResponse:
        param = exc.param if isinstance(exc, BadRequest) else None
        return JSONResponse(error_body(str(exc), param=param), status_code=400)

    async def body_of(request: Request) -> object:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(f"the request body is not valid JSON: {exc}") from None

    def check_model(parsed: ParsedRequest) -> JSONResponse | None:
        if parsed.model is None or parsed.model == model_name:
            return None
        return JSONResponse(error_body(f"The model `{parsed.model}` does not exist.", kind="NotFoundError",
                                       param="model", code=404), status_code=404)

    async def run(request: Request, parsed: ParsedRequest, rid: str, kind: str, choice: Choice,
                  head: Callable[[int], list[dict[str, Any]]] | None = None) -> Any:
        for p in parsed.prompts:  # refuse bad requests before any output (400, not a stream)
            await asyncio.to_thread(llm.engine.check_request, p, parsed.params)
        n = parsed.params.n
        gens = [llm.generate(p, parsed.params, request_id=f"{rid}-{i}") for i, p in enumerate(parsed.prompts)]
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
            choices = [choice(i * n + c.index, c, False) for i, o in enumerate(outs) for c in o.outputs]
            return JSONResponse({**envelope(kind, model_name, rid), "choices": choices, "usage": usage(outs)})

        async def events() -> AsyncIterator[str]:
            base = envelope(kind + ".chunk" if kind == "chat.completion" else kind, model_name, rid)
            prompt_tokens: dict[int, int] = {}
            completion_tokens = 0
            try:
                if head is not None:
                    yield _sse({**base, "choices": head(len(gens) * n)})
                async for i, out in _merged(gens):
                    prompt_tokens[i] = len(out.prompt_token_ids)
                    completion_tokens += sum(len(c.token_ids) for c in out.outputs)
                    choices = [choice(i * n + c.index, c, True) for c in out.outputs]
                    yield _sse({**base, "choices": choices})
                if parsed.include_usage:
                    p = sum(prompt_tokens.values())
                    yield _sse({**base, "choices": [], "usage": {
                        "prompt_tokens": p, "completion_tokens": completion_tokens,
                        "total_tokens": p + completion_tokens}})
            except Exception as exc:  # the headers are gone: report in the stream
                yield _sse(error_body(str(exc), kind=type(exc).__name__, code=500))
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if llm.is_running else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "deepinfer_kit"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        parsed = parse_completion(await body_of(request))
        missing = check_model(parsed)
        if missing is not None:
            return missing
        k = parsed.params.logprobs or 0
        offsets: dict[int, int] = {}

        def choice(index: int, c: Any, delta: bool) -> dict[str, Any]:
            body = completion_choice(index, c, k, offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + len(c.text)
            return body

        return await run(request, parsed, new_id("cmpl"), "text_completion", choice)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        parsed, template = parse_chat(await body_of(request))
        missing = check_model(parsed)
        if missing is not None:
            return missing
        if template["chat_template"] is None:
            template["chat_template"] = chat_template
        conversation = template.pop("conversation")
        text, ids = llm.chat_renderer.render(conversation, "messages", **template)
        parsed = ParsedRequest([ids], parsed.params, parsed.stream, parsed.include_usage, parsed.model)
        k = parsed.params.logprobs or 0

        def choice(index: int, c: Any, delta: bool) -> dict[str, Any]:
            return chat_choice(index, c, k, delta=delta)

        def head(count: int) -> list[dict[str, Any]]:
            return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None} for i in range(count)]

        return await run(request, parsed, new_id("chatcmpl"), "chat.completion", choice, head)

    return app
