"""SequenceStream: the engine's observer of one sequence — its incremental text, its stop
strings, the ``decoded_token`` of its logprobs — and what of it was already reported."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer_kit.engine.detokenizer import IncrementalDetokenizer, find_stop
from deepinfer_kit.outputs import Logprob
from deepinfer_kit.request import FinishReason, Request
from deepinfer_kit.sample.params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from deepinfer_kit.request import TokenObserver

__all__ = ["SequenceStream"]


class SequenceStream:
    """Follows one sequence (completion ``request.index``) for the engine.

    Called by the scheduler's commit for each appended token (:meth:`on_token`), so a
    stop string finishes the request inside the commit, exactly like a stop token: the
    tokens after it in a verified run are never appended, a token of the request already
    scheduled in the next (overlapped) round is discarded, and the blocks are freed on
    the scheduler's one finishing path. Text visible before the end holds back the last
    ``len(longest stop) - 1`` characters (a stop string may still be completing there)
    unless ``include_stop_str_in_output``, so reported text only ever grows.

    A sequence whose tokens nothing reads before it finishes (:meth:`follows_lazily`: one
    completion reported once finished, no stop strings, no logprobs) is followed lazily
    instead: the engine does not attach the stream as its observer (so the scheduler's
    commit checks only the tokens that may stop it), and :meth:`text` first pushes the
    tokens appended since — the same tokens, in the same order, as ``on_token`` would
    have (a final stop token only with ``include_stop_str_in_output``), so the same text.

    Args:
        request: the sequence.
        detokenizer: its text; ``None`` when the request asked for no text (or the engine
            has no tokenizer).
        streams: the completions of the user request, by index; this stream (and every
            fork's) registers itself there.
        lazy: follow the sequence lazily (never its observer); only for a request that
            :meth:`follows_lazily`.
    """

    __slots__ = (
        "request", "_detok", "_streams", "_checked", "_stopped", "_flushed", "_lazy", "_pushed",
        "sent_tokens", "sent_chars", "sent_finished",
    )

    def __init__(
        self,
        request: Request,
        detokenizer: IncrementalDetokenizer | None,
        streams: dict[int, SequenceStream],
        *,
        lazy: bool = False,
    ) -> None:
        self.request = request
        self._detok = detokenizer
        self._streams = streams
        streams[request.index] = self
        self._checked = 0  # text searched for stop strings up to here
        self._stopped = False
        self._flushed = False
        self._lazy = lazy
        self._pushed = 0  # lazy: output tokens already given to the detokenizer
        self.sent_tokens = 0  # tokens, logprobs and characters already reported
        self.sent_chars = 0
        self.sent_finished = False

    def on_token(self, request: Request, stop_terminated: bool) -> str | None:
        """See :class:`~deepinfer_kit.request.TokenObserver`: detokenises the new token
        (a stop token only with ``include_stop_str_in_output``), fills the
        ``decoded_token`` of its logprobs, and searches the new text for stop strings
        once ``min_tokens`` tokens were generated; a match cuts the text before it (after
        it with ``include_stop_str_in_output``)."""
        detok = self._detok
        if detok is None:
            return None
        params = request.params
        token = request.output_token_ids[-1]
        if request.logprobs:
            decode = detok.decode_one
            request.logprobs[-1] = {
                tid: Logprob(lp.logprob, lp.rank, decode(tid))
                for tid, lp in request.logprobs[-1].items()
            }
        if stop_terminated:
            if params.include_stop_str_in_output:
                detok.push(token)
            return None
        detok.push(token)
        if not params.stop:  # nothing to search (and never will be: params do not change)
            return None
        if len(request.output_token_ids) <= params.min_tokens:
            self._checked = len(detok.text)
            return None
        found = find_stop(detok.text, self._checked, params.stop)
        self._checked = len(detok.text)
        if found is None:
            return None
        stop, start = found
        detok.text = detok.text[: start + len(stop) if params.include_stop_str_in_output else start]
        self._stopped = True
        return stop

    def fork(self, child: Request) -> TokenObserver:
        """A stream for fork child ``child`` starting from this one's text state."""
        detok = self._detok.copy() if self._detok is not None else None
        twin = SequenceStream(child, detok, self._streams)
        twin._checked = self._checked
        return twin

    @staticmethod
    def follows_lazily(params: SamplingParams) -> bool:
        """True when no token of a request with ``params`` is read before it finishes: one
        completion (no forks), reported only once finished (``FINAL_ONLY``, or ``None``,
        the engine's default), no stop strings to search, no logprobs to decode."""
        return (params.n == 1 and not params.stop and params.logprobs is None
                and params.output_kind in (None, RequestOutputKind.FINAL_ONLY))

    def _catch_up(self) -> None:
        """Lazy: push the tokens appended since the last call, as ``on_token`` would."""
        detok = self._detok
        request = self.request
        tokens = request.output_token_ids
        end = len(tokens)
        if (request.finish_reason is FinishReason.STOP and end > self._pushed
                and not request.params.include_stop_str_in_output):
            end -= 1  # the stop token that ended it (no stop strings here): never text
        if detok is not None:
            push = detok.push
            for token in tokens[self._pushed:end]:
                push(token)
        self._pushed = len(tokens)

    def text(self) -> str:
        """The text to report now: all of it once the sequence finished (held-back bytes
        flushed unless a stop string ended it), else without the stop-string hold-back."""
        detok = self._detok
        if detok is None:
            return ""
        if self._lazy:
            self._catch_up()
        if self.request.is_finished:
            if not self._stopped and not self._flushed:
                detok.flush()
                self._flushed = True
            return detok.text
        params = self.request.params
        if params.stop and not params.include_stop_str_in_output:
            hold = max(len(s) for s in params.stop) - 1
            return detok.text[: max(len(detok.text) - hold, 0)] if hold else detok.text
        return detok.text


if TYPE_CHECKING:
    _check: type[TokenObserver] = SequenceStream
