"""OutputGroups: gathers the completions of each user request (``n`` of them) and hands
a request's output out once every completion finished."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from deepinfer_kit.outputs import CompletionOutput, RequestOutput
from deepinfer_kit.request import Request

__all__ = ["OutputGroups"]


@attrs.define(slots=True, eq=False)
class _Group:
    """The completions of one user request gathered until all ``n`` finish."""

    user_id: str
    request: Request
    completions: dict[int, CompletionOutput] = attrs.field(factory=dict)
    num_cached_tokens: int = 0


class OutputGroups:
    """Live user requests, keyed by the id the scheduler knows them under.

    A user's id is free again the moment its request is aborted, so a reused id can be
    live while the aborted request's output is still to come: each request gets a
    scheduler id of its own (the user's id, suffixed ``~k`` only on such a reuse), and
    outputs are routed by it.

    Args:
        decode: token ids -> text of a completion.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._groups: dict[str, _Group] = {}  # scheduler id -> group
        self._live: dict[str, str] = {}  # user id -> scheduler id, until aborted or done
        self._reuse = 0

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
        """Register ``request`` (whose ``request_id`` is its scheduler id) for ``user_id``."""
        self._groups[request.request_id] = _Group(user_id, request)
        self._live[user_id] = request.request_id

    def discard(self, user_id: str) -> None:
        """Forget a request that was never queued (the scheduler refused it)."""
        sid = self._live.pop(user_id, None)
        if sid is not None:
            self._groups.pop(sid, None)

    def close_live(self, user_id: str) -> str | None:
        """Free ``user_id`` for reuse (an abort); returns its scheduler id, or ``None``
        when it is not live. Its output still comes through :meth:`collect`."""
        return self._live.pop(user_id, None)

    def collect(self, finished: list[RequestOutput]) -> tuple[list[RequestOutput], int]:
        """Merge finished sequences (reported by the scheduler under scheduler ids) into
        their user request; returns the requests whose every completion finished, under
        the user's id, and their prefix-cache hit tokens summed."""
        done: list[RequestOutput] = []
        cached = 0
        for out in finished:
            group = self._groups.get(out.request_id)
            if group is None:
                continue
            for completion in out.outputs:
                completion.text = self._decode(completion.token_ids)
                group.completions[completion.index] = completion
            if out.outputs and out.outputs[0].index == 0:
                group.num_cached_tokens = out.num_cached_tokens
            req = group.request
            n = req.params.n
            if len(group.completions) < n:
                continue
            del self._groups[out.request_id]
            if self._live.get(group.user_id) == out.request_id:
                del self._live[group.user_id]
            cached += group.num_cached_tokens
            done.append(
                RequestOutput(
                    request_id=group.user_id,
                    prompt=req.prompt_text,
                    prompt_token_ids=list(req.prompt_token_ids),
                    outputs=[group.completions[i] for i in range(n)],
                    finished=True,
                    num_cached_tokens=group.num_cached_tokens,
                    metrics=out.metrics,
                )
            )
        return done, cached
