"""OutputGroups: gathers the completions of each user request (``n`` of them) and hands
its outputs out as its ``output_kind`` asks: every round it produced tokens (cumulative or
delta), or once every completion finished."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from deepinfer_kit.engine.detokenizer import IncrementalDetokenizer
from deepinfer_kit.engine.streams import SequenceStream
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from deepinfer_kit.request import Request
from deepinfer_kit.sample.params import RequestOutputKind

__all__ = ["OutputGroups"]

_FINAL_ONLY = RequestOutputKind.FINAL_ONLY
_DELTA = RequestOutputKind.DELTA


@attrs.define(slots=True, eq=False)
class _Group:
    """The completions of one user request: a stream per started completion, and the
    finished ones as the scheduler reported them."""

    user_id: str
    request: Request
    streams: dict[int, SequenceStream] = attrs.field(factory=dict)
    completions: dict[int, CompletionOutput] = attrs.field(factory=dict)
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None  # of the last completion that finished
    sent_prompt_logprobs: bool = False  # a DELTA stream reports them once, first


class OutputGroups:
    """Live user requests, keyed by the id the scheduler knows them under.

    A user's id is free again the moment its request is aborted, so a reused id can be
    live while the aborted request's output is still to come: each request gets a
    scheduler id of its own (the user's id, suffixed ``~k`` only on such a reuse), and
    outputs are routed by it.

    Args:
        detokenizer: a new detokenizer for a request, or ``None`` when it gets no text.
    """

    def __init__(self, detokenizer: Callable[[Request], IncrementalDetokenizer | None]) -> None:
        self._detokenizer = detokenizer
        self._groups: dict[str, _Group] = {}  # scheduler id -> group
        self._live: dict[str, str] = {}  # user id -> scheduler id, until aborted or done
        self._streaming: dict[str, _Group] = {}  # groups reported while they run
        self._reuse = 0
        self._auto_ids = 0

    def claim(self, request_id: str | None) -> str:
        """The user id of a new request: ``request_id``, or a fresh ``req-N`` when ``None``.

        Raises:
            ConfigError: ``request_id`` is not a non-empty str, or names a live request.
        """
        if request_id is None:
            while True:
                rid = f"req-{self._auto_ids}"
                self._auto_ids += 1
                if rid not in self._live:
                    return rid
        if not isinstance(request_id, str) or not request_id:
            raise ConfigError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self._live:
            raise ConfigError(f"request_id {request_id!r} is already in use by a live request")
        return request_id

    def __len__(self) -> int:
        """User requests added and not yet handed out."""
        return len(self._groups)

    def is_live(self, user_id: str) -> bool:
        """True while ``user_id`` names a request neither aborted nor finished."""
        return user_id in self._live

    def live_ids(self) -> list[str]:
        """The live user ids (for error messages)."""
        return sorted(self._live)

    def scheduler_id(self, user_id: str) -> str:
        """A scheduler id for a new request of ``user_id`` (not live): the id itself
        unless an aborted request of that id still awaits its output."""
        if user_id not in self._groups:
            return user_id
        while True:
            self._reuse += 1
            sid = f"{user_id}~{self._reuse}"
            if sid not in self._groups:
                return sid

    def open(self, user_id: str, request: Request) -> None:
        """Register ``request`` (whose ``request_id`` is its scheduler id) for ``user_id``
        with its :class:`SequenceStream`, attached as ``request.observer`` unless the
        stream follows it lazily (:meth:`SequenceStream.follows_lazily`)."""
        group = _Group(user_id, request)
        lazy = SequenceStream.follows_lazily(request.params)
        stream = SequenceStream(request, self._detokenizer(request), group.streams, lazy=lazy)
        if not lazy:  # a lazy stream catches up when its text is read
            request.observer = stream
        self._groups[request.request_id] = group
        self._live[user_id] = request.request_id
        if request.params.output_kind not in (_FINAL_ONLY, None):  # None: FINAL_ONLY here
            self._streaming[request.request_id] = group

    def discard(self, user_id: str) -> None:
        """Forget a request that was never queued (the scheduler refused it)."""
        sid = self._live.pop(user_id, None)
        if sid is not None:
            self._groups.pop(sid, None)
            self._streaming.pop(sid, None)

    def close_live(self, user_id: str) -> str | None:
        """Free ``user_id`` for reuse (an abort); returns its scheduler id, or ``None``
        when it is not live. Its output still comes through :meth:`collect`."""
        return self._live.pop(user_id, None)

    def collect(self, finished: list[RequestOutput]) -> tuple[list[RequestOutput], int]:
        """The outputs of one committed round, under the users' ids: every request whose
        completions all finished, and every streaming (CUMULATIVE / DELTA) request that
        produced tokens or finished a completion in it. ``finished`` are the sequences the
        scheduler reported finished (under scheduler ids). Also returns the finished
        requests' prefix-cache hit tokens summed."""
        touched: dict[str, _Group] = {}
        for out in finished:
            group = self._groups.get(out.request_id)
            if group is None:
                continue
            for completion in out.outputs:
                stream = group.streams.get(completion.index)
                completion.text = stream.text() if stream is not None else ""
                group.completions[completion.index] = completion
            if out.outputs and out.outputs[0].index == 0:
                group.num_cached_tokens = out.num_cached_tokens
            group.metrics = out.metrics
            touched[out.request_id] = group
        for sid, group in self._streaming.items():
            if sid not in touched and any(
                s.request.num_output_tokens > s.sent_tokens for s in group.streams.values()
            ):
                touched[sid] = group
        done: list[RequestOutput] = []
        cached = 0
        for sid, group in touched.items():
            req = group.request
            complete = len(group.completions) >= req.params.n
            if complete:
                del self._groups[sid]
                self._streaming.pop(sid, None)
                if self._live.get(group.user_id) == sid:
                    del self._live[group.user_id]
                cached += group.num_cached_tokens
            kind = req.params.output_kind or _FINAL_ONLY  # None: the engine's default
            if kind is _FINAL_ONLY and not complete:
                continue
            outputs = self._completions(group, kind)
            if outputs or complete:
                done.append(
                    RequestOutput(
                        request_id=group.user_id,
                        prompt=req.prompt_text,
                        prompt_token_ids=list(req.prompt_token_ids),
                        outputs=outputs,
                        finished=complete,
                        num_cached_tokens=(
                            group.num_cached_tokens if complete else req.num_cached_tokens
                        ),
                        metrics=group.metrics if group.metrics is not None else req.metrics,
                        prompt_logprobs=self._prompt_logprobs(group, kind),
                    )
                )
        return done, cached

    def _prompt_logprobs(
        self, group: _Group, kind: RequestOutputKind
    ) -> list[dict[int, Logprob] | None] | None:
        """The group's prompt logprobs, with ``decoded_token`` filled when it gets text;
        a copy (``None`` in a DELTA report after the first, as vLLM). O(prompt tokens *
        alternatives) decodes."""
        req = group.request
        maps = req.prompt_logprobs
        if maps is None or (kind is _DELTA and group.sent_prompt_logprobs):
            return None
        group.sent_prompt_logprobs = True
        detok = self._detokenizer(req)
        if detok is None:
            return list(maps)
        return [
            None if m is None
            else {t: Logprob(lp.logprob, lp.rank, detok.decode_one(t)) for t, lp in m.items()}
            for m in maps
        ]

    def _completions(self, group: _Group, kind: RequestOutputKind) -> list[CompletionOutput]:
        """The completions to report for ``group``: all of them (cumulative, and final
        only) or those with news since the last report, trimmed to the news (delta)."""
        n = group.request.params.n
        if kind is _FINAL_ONLY:
            return [group.completions[i] for i in range(n)]
        outputs: list[CompletionOutput] = []
        for i in range(n):
            stream = group.streams.get(i)
            done = group.completions.get(i)
            if done is None and stream is None:
                continue
            if done is None:
                assert stream is not None
                done = stream.request.completion(stream.text())
            sent_tokens, sent_chars = (0, 0) if stream is None else (stream.sent_tokens, stream.sent_chars)
            news = len(done.token_ids) > sent_tokens or (
                done.finish_reason is not None and not (stream is not None and stream.sent_finished)
            )
            if stream is not None:
                stream.sent_tokens = len(done.token_ids)
                stream.sent_chars = len(done.text)
                stream.sent_finished = done.finish_reason is not None
            if kind is _DELTA:
                if not news:
                    continue
                done = attrs.evolve(
                    done,
                    text=done.text[sent_chars:],
                    token_ids=done.token_ids[sent_tokens:],
                    logprobs=done.logprobs[sent_tokens:] if done.logprobs is not None else None,
                )
            outputs.append(done)
        return outputs
