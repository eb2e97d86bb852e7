"""IncrementalDetokenizer: the text of one sequence's generated tokens, built token by
token, never showing a character whose bytes are still split over tokens; and
``find_stop``, the incremental stop-string search over that text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from deepinfer_kit.models.tokenizer import ByteTokenizer

if TYPE_CHECKING:
    from deepinfer_kit.models.protocols import Tokenizer
    from deepinfer_kit.request import Request

__all__ = ["IncrementalDetokenizer", "detokenizer_for", "find_stop", "CONTEXT_TOKENS"]

CONTEXT_TOKENS = 5
"""Prompt tokens decoded ahead of the output, so tokenizers whose decoders treat the first
token specially (a leading-space marker) give the output's text as a continuation."""

_REPLACEMENT = "\ufffd"
_ASCII = tuple(chr(b) for b in range(128))


class IncrementalDetokenizer:
    """The text of the tokens pushed so far, for one sequence.

    Keeps two offsets into the tokens (context plus outputs): ``prefix`` where the last
    decoded window starts and ``read`` where its already-emitted part ends. Each push
    decodes ``tokens[prefix:]`` and emits what it adds to ``tokens[prefix:read]``, unless
    the window ends in U+FFFD: then the last character's bytes are not all there yet (a
    multi-byte UTF-8 character split over byte-fallback or byte-level tokens) and the
    text is held back until a later token completes it. :meth:`flush` emits what is still
    held when the sequence ends, so the final text equals the tokenizer's decode of the
    whole output. Two short decodes per token, O(window) each.

    With the :class:`ByteTokenizer`, an ASCII byte costs fewer: UTF-8 never continues a
    character with an ASCII byte, so the window with one appended is the window before
    it plus its character (``tail``, the decode of ``tokens[prefix:]``, is kept), and
    alone it decodes to that character. Such a push reaches the state the two decodes
    would, with one decode (text held back before it) or none.

    Args:
        tokenizer: decodes token ids (any :class:`~deepinfer_kit.models.protocols.Tokenizer`).
        prompt_ids: the prompt; its last :data:`CONTEXT_TOKENS` tokens are the context.
        skip_special_tokens: leave special tokens out of the text.
        pieces: token id -> its text alone (:meth:`decode_one`), filled on first use; one
            dict may be shared by every detokenizer of a tokenizer, so a whole-vocabulary
            logprobs row decodes each id once, not once per token.
    """

    __slots__ = (
        "_tokenizer", "_ids", "_prefix", "_read", "_prefix_text", "_tail", "_skip", "_pieces", "_bytes",
        "text",
    )

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        pieces: dict[int, str] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._bytes = type(tokenizer) is ByteTokenizer  # the ASCII shortcut of push holds
        self._skip = skip_special_tokens
        self._pieces: dict[int, str] = pieces if pieces is not None else {}
        self._ids: list[int] = list(prompt_ids[-CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)
        self._prefix_text = self._tail = self._decode(self._ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        if self._bytes:
            try:  # ByteTokenizer.decode's own first step, without its call
                return bytes(ids).decode("utf-8", "replace")
            except ValueError:
                pass  # a special id: the tokenizer's rules
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def push(self, token: int) -> str:
        """Append ``token``; returns the text it completed (``""`` while held back).

        Mutates ``text`` and the offsets. Raises what the tokenizer raises for an id
        outside its vocabulary.
        """
        ids = self._ids
        ids.append(token)
        ascii_byte = self._bytes and 0 <= token < 128
        window = self._tail + _ASCII[token] if ascii_byte else self._decode(ids[self._prefix:])
        done = len(self._prefix_text)
        if len(window) <= done or window.endswith(_REPLACEMENT):
            self._tail = window
            return ""
        delta = window[done:]
        self.text += delta
        read = self._read
        self._prefix, self._read = read, len(ids)
        if ascii_byte and read == len(ids) - 1:
            self._prefix_text = self._tail = _ASCII[token]
        else:
            self._prefix_text = self._tail = self._decode(ids[read:])
        return delta

    def flush(self) -> str:
        """Emit the text still held back (an incomplete character at the end becomes
        U+FFFD, as in a full decode); returns it. Called once, when the sequence ends."""
        if self._read == len(self._ids):
            return ""
        window = self._decode(self._ids[self._prefix:])
        delta = window[len(self._prefix_text):]
        self.text += delta
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._tail = self._decode(self._ids[self._prefix:self._read])
        return delta

    def decode_one(self, token: int) -> str:
        """``token`` decoded alone with its special-token name kept (what a logprob's
        ``decoded_token`` shows; a lone byte of a multi-byte character is U+FFFD); cached
        in ``pieces``."""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self._tokenizer.decode([token], skip_special_tokens=False)
        return piece

    def copy(self) -> IncrementalDetokenizer:
        """An independent detokenizer in the same state (a fork child's starts here)."""
        twin = IncrementalDetokenizer.__new__(IncrementalDetokenizer)
        twin._tokenizer = self._tokenizer
        twin._bytes = self._bytes
        twin._skip = self._skip
        twin._pieces = self._pieces
        twin._ids = list(self._ids)
        twin._prefix, twin._read = self._prefix, self._read
        twin._prefix_text, twin._tail = self._prefix_text, self._tail
        twin.text = self.text
        return twin


def find_stop(text: str, new_from: int, stops: Sequence[str]) -> tuple[str, int] | None:
    """The stop string occurrence in ``text`` that ends after ``new_from`` (the first
    index of the text added since the last search) and starts earliest; ties go to the
    first string in ``stops``. Returns ``(stop, start index)`` or ``None``.

    An occurrence ending at or before ``new_from`` was the previous search's to find, so
    searching only ``text[new_from - len(stop) + 1:]`` finds a stop split across tokens
    exactly once. O(len(stops) * (new text + longest stop)).
    """
    best: tuple[str, int] | None = None
    for stop in stops:
        start = text.find(stop, max(0, new_from - len(stop) + 1))
        if start != -1 and (best is None or start < best[1]):
            best = (stop, start)
    return best


def detokenizer_for(
    tokenizer: Tokenizer | None, request: Request, pieces: dict[int, str] | None = None
) -> IncrementalDetokenizer | None:
    """A new detokenizer of ``request``'s output under its ``skip_special_tokens``, or
    ``None`` when it gets no text (no tokenizer, or ``detokenize=False``); ``pieces``: the
    tokenizer's shared :meth:`~IncrementalDetokenizer.decode_one` cache."""
    if tokenizer is None or not request.params.detokenize:
        return None
    return IncrementalDetokenizer(
        tokenizer,
        request.prompt_token_ids,
        skip_special_tokens=request.params.skip_special_tokens,
        pieces=pieces,
    )
