"""AsyncLLM: ``async for out in llm.generate(...)`` over one engine stepped by one
background thread; cancelling a consumer aborts its request."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import Any, TypeVar

import attrs

from deepinfer_kit.cache.tiers.config import KVRequestParams
from deepinfer_kit.disagg.role import PromptSaves, check_kv_role, role_request
from deepinfer_kit.engine.engine import Engine
from deepinfer_kit.engine.llm import LLM, SinglePrompt, one_prompt
from deepinfer_kit.errors import ConfigError, EngineDeadError
from deepinfer_kit.outputs import RequestOutput
from deepinfer_kit.sample.params import RequestOutputKind, SamplingParams

__all__ = ["AsyncLLM", "StepTimes"]

T = TypeVar("T")

_Item = RequestOutput | BaseException


STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@attrs.define(slots=True)
class StepTimes:
    """Durations of the engine's rounds as a histogram (counts per upper bound in
    ``buckets``, plus one for larger values), written by the engine thread only; read it
    through :meth:`AsyncLLM.call` for a consistent copy."""

    buckets: tuple[float, ...] = STEP_BUCKETS_S
    counts: list[int] = attrs.field(
        default=attrs.Factory(lambda self: [0] * (len(self.buckets) + 1), takes_self=True))
    count: int = 0
    total_s: float = 0.0

    def observe(self, seconds: float) -> None:
        """Count one round of ``seconds``. O(buckets)."""
        i = 0
        while i < len(self.buckets) and seconds > self.buckets[i]:
            i += 1
        self.counts[i] += 1
        self.count += 1
        self.total_s += seconds

    def copy(self) -> StepTimes:
        """A snapshot."""
        return StepTimes(self.buckets, list(self.counts), self.count, self.total_s)


@attrs.define(slots=True)
class _Stream:
    """Where one request's outputs go: a queue read by its consumer on ``loop``."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[_Item]

    def push(self, item: _Item) -> None:
        """Called from the engine thread; hands ``item`` to the consumer's loop."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening
            pass


class AsyncLLM:
    """Streams the outputs of many concurrent requests from one engine.

    One background thread owns the stepping: it applies queued adds and aborts between
    rounds, calls ``Engine.step()`` while any request is unfinished, and hands each output
    to the event loop of the request's consumer. Consumers never block their loop on the
    engine.

    A request that saves its prompt to the KV tiers (``kv={"save_prompt": True}``, every
    request of a prefill server) gets its final output once the tiers report the prompt's
    blocks down (:class:`~deepinfer_kit.disagg.role.PromptSaves`), so whoever reads them
    next finds them.

    Args:
        model: as :class:`~deepinfer_kit.engine.llm.LLM` (a checkpoint folder or ``"tiny"``).
        engine: an already built engine (then no other options).
        kv_role: ``"prefill"`` or ``"decode"``: this server's part in a prefill/decode pair
            sharing a KV folder (:func:`~deepinfer_kit.disagg.role.role_request`); ``None``
            serves whole requests.
        **config: :class:`~deepinfer_kit.engine.config.EngineConfig` fields, as ``LLM``.

    Raises:
        ConfigError, CheckpointError: as ``LLM``; a ``kv_role`` the engine cannot play
            (no KV tiers with a disk folder).
    """

    def __init__(self, model: str = "tiny", *, engine: Engine | None = None, kv_role: str | None = None,
                 **config: Any) -> None:
        self.llm = LLM(model, engine=engine, **config)
        self.engine = self.llm.engine
        self._owns_engine = engine is None  # built here: shutdown closes it
        try:
            check_kv_role(kv_role, self.engine)
        except ConfigError:
            if self._owns_engine:
                self.engine.close()
            raise
        self.kv_role = kv_role
        self._saves = PromptSaves(self.engine)
        self.chat_renderer = self.llm.chat_renderer
        self._streams: dict[str, _Stream] = {}
        self._live: dict[str, str] = {}  # user request id -> engine id
        self._keys = itertools.count()
        self._commands: deque[Callable[[], None]] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._error: BaseException | None = None
        self.step_times = StepTimes()
        self._thread = threading.Thread(target=self._run, name="deepinfer-async-llm", daemon=True)
        self._thread.start()

    # ---- the consumer's side -------------------------------------------------------------

    async def generate(
        self,
        prompt: SinglePrompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        kv: KVRequestParams | Mapping[str, Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs as the engine produces them.

        ``prompt`` is a text, token ids, ``{"prompt": text}`` or ``{"prompt_token_ids":
        ids}``. With ``output_kind`` CUMULATIVE (the default, as in vLLM: also when the
        params leave ``output_kind`` as ``None``) each output holds everything so far;
        DELTA only what is new; FINAL_ONLY yields once. ``kv``: the request's KV tier
        parameters (``Engine.add_request``'s; a ``kv_role`` fills them when ``None``).
        The last output has ``finished`` True. Closing the generator or cancelling the
        task that iterates it before then aborts the request (its blocks are freed by the
        engine's next round).

        Raises:
            ConfigError: a request id already live here, or what ``Engine.add_request``
                raises for this request (raised by the first iteration; other requests
                are unaffected).
            EngineDeadError: the engine died or this AsyncLLM was shut down.
        """
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ConfigError(f"sampling_params must be SamplingParams, got {params!r}")
        if params.output_kind is None:  # vLLM's AsyncLLM streams by default
            params = attrs.evolve(params, output_kind=RequestOutputKind.CUMULATIVE)
        params, kv_params = role_request(self.kv_role, params, kv)
        prompt = one_prompt(prompt, "prompt")
        self._check_running()
        if params.structured_outputs is not None:  # its grammar compiles here, off the engine thread
            await asyncio.to_thread(self.engine.check_request, prompt, params, priority=priority)
        rid = request_id if request_id is not None else f"async-{next(self._keys)}"
        if rid in self._live:
            raise ConfigError(f"request_id {rid!r} is already in use by a live request")
        key = f"{rid}#{next(self._keys)}"  # unique even when a user id is reused at once
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._live[rid] = key
        self._streams[key] = stream
        self._submit(lambda: self._add(key, prompt, params, priority, kv_params))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                item.request_id = rid
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(key, None)
            if self._live.get(rid) == key:
                del self._live[rid]
            if not finished:
                self._submit(lambda: self._abort(key))

    async def abort(self, request_id: str | Iterable[str]) -> bool:
        """Abort live requests (one id or several, as vLLM's ``abort``): each consumer's
        next output is its final one, with finish reason ``abort``. Returns True when any
        of the ids was live; ids that are not live are skipped."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        keys = [key for key in (self._live.get(rid) for rid in ids) if key is not None]
        if not keys:
            return False
        return await self.call(lambda: any([self.engine.abort(key) for key in keys]))

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread between two rounds and return its result (or
        raise its exception); for reading engine state consistently."""
        self._check_running()
        done: Future[T] = Future()

        def run() -> None:
            try:
                done.set_result(fn())
            except BaseException as exc:  # handed to the caller
                done.set_exception(exc)

        self._submit(run)
        return await asyncio.wrap_future(done)

    async def wait_idle(self, poll_s: float = 0.005) -> None:
        """Wait until no request is live, then run ``Engine.check_idle()`` on the engine
        thread (raises :class:`InvariantError` naming held blocks or requests)."""
        while True:
            busy = await self.call(lambda: bool(self._streams) or self.engine.has_unfinished_requests())
            if not busy:
                break
            await asyncio.sleep(poll_s)
        await self.call(self._flush_and_check)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort every live request, let the engine finish them, stop the thread, then
        close the engine when this AsyncLLM built it (its worker process with
        ``worker="process"``; an engine passed in stays the caller's to close). Consumers
        still waiting get :class:`EngineDeadError`. Idempotent; safe from any thread."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
            if self._owns_engine and not self._thread.is_alive():
                self.engine.close()

    @property
    def num_answers_held(self) -> int:
        """Final outputs held until their prompt's blocks are down (``save_prompt``
        requests; read on the engine thread, through :meth:`call`)."""
        return self._saves.num_held

    @property
    def is_running(self) -> bool:
        """True until :meth:`shutdown` or an engine death."""
        return self._thread.is_alive() and not self._stopping

    # ---- the engine thread ------------------------------------------------------------------

    def _check_running(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine loop stopped: {self._error}") from self._error
        if self._stopping or not self._thread.is_alive():
            raise EngineDeadError("AsyncLLM is shut down")

    def _submit(self, command: Callable[[], None]) -> None:
        with self._wake:
            self._commands.append(command)
            self._wake.notify()

    def _add(self, key: str, prompt: str | list[int], params: SamplingParams, priority: int,
             kv: KVRequestParams | None) -> None:
        stream = self._streams.get(key)
        if stream is None:  # the consumer left before its request was queued
            return
        try:
            self.engine.add_request(key, prompt, params, priority=priority, kv=kv)
        except Exception as exc:  # the request's own error goes to its consumer only
            stream.push(exc)
            return
        self._saves.watch(key, kv)

    def _abort(self, key: str) -> None:
        self.engine.abort(key)

    def _flush_and_check(self) -> None:
        for out in self.engine.flush():
            self._dispatch(out)
        self.engine.check_idle()

    def _dispatch(self, out: RequestOutput) -> None:
        if self._saves.hold(out):  # answered once its prompt is down
            return
        self._send(out)

    def _send(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is not None:
            stream.push(out)

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while not (self._commands or self._stopping
                               or self.engine.has_unfinished_requests()):
                        self._wake.wait()
                    commands = list(self._commands)
                    self._commands.clear()
                    stopping = self._stopping
                for command in commands:
                    command()
                if stopping:
                    self._drain()
                    return
                if self.engine.has_unfinished_requests():
                    t0 = time.perf_counter()
                    outputs = self.engine.step()
                    self.step_times.observe(time.perf_counter() - t0)
                    for out in outputs:
                        self._dispatch(out)
                    if not self.engine.has_unfinished_requests():
                        for out in self.engine.flush():
                            self._dispatch(out)
                self._saves.release(self._send)  # idle: pushes the tiers, so nothing stays held
        except BaseException as exc:  # the engine died: every consumer hears it
            self._error = exc
            self._fail_all(EngineDeadError(f"the engine loop stopped: {exc}"))

    def _drain(self) -> None:
        """Abort everything and step until the engine holds nothing (shutdown)."""
        for key in list(self._streams):
            self.engine.abort(key)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        self.engine.flush()
        self._fail_all(EngineDeadError("AsyncLLM is shut down"))

    def _fail_all(self, exc: BaseException) -> None:
        for stream in list(self._streams.values()):
            stream.push(exc)
