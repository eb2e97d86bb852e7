"""XGrammarMatcher: the GrammarMatcher over an ``xgrammar.GrammarMatcher``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from deepinfer_kit.errors import ConfigError, InvariantError
from deepinfer_kit.sample.structured.bitmask import bitmask_row, bitmask_words

__all__ = ["XGrammarMatcher", "TokenGuard", "json_guard", "check_bitmask_row"]

_NEVER_IN_JSON = frozenset(range(0x20)) - {0x09, 0x0A, 0x0D}
"""Bytes that JSON text never holds raw: control characters other than its whitespace."""


@attrs.frozen(slots=True, eq=False)
class TokenGuard:
    """Tokens a grammar's masks never allow, whatever its backend says (see :func:`json_guard`).

    Attributes:
        banned: their ids.
        allowed: int32 ``[ceil(V / 32)]`` host words, every bit set but the banned ids'
            (AND-ed into each mask row).
    """

    banned: frozenset[int]
    allowed: torch.Tensor


def json_guard(decoded_vocab: Sequence[bytes], vocab_size: int, *, compact: bool) -> TokenGuard:
    """The guard of a JSON grammar: tokens holding a byte JSON text never holds raw (control
    characters; with ``compact`` — no free whitespace — also tab, newline and carriage
    return, which JSON allows only between tokens).

    xgrammar 0.2.9 lets a string with ``minLength`` / ``maxLength`` (and some ``pattern`` s)
    take raw control characters, which no JSON parser accepts; this closes that for every
    tokenizer (a token is banned when any of its bytes is). O(total bytes of the vocabulary).
    """
    never = _NEVER_IN_JSON | ({0x09, 0x0A, 0x0D} if compact else set())
    banned = frozenset(i for i, raw in enumerate(decoded_vocab[:vocab_size]) if any(b in never for b in raw))
    return TokenGuard(banned, bitmask_row((t for t in range(vocab_size) if t not in banned), vocab_size))


def check_bitmask_row(bitmask: torch.Tensor, row: int, vocab_size: int) -> None:
    """Raise ConfigError unless ``bitmask`` is a host int32 ``[N, ceil(V / 32)]`` tensor and
    ``row`` is in ``[0, N)``."""
    words = bitmask_words(vocab_size)
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2 \
            or bitmask.shape[1] != words:
        raise ConfigError(f"bitmask must be a host int32 [N, {words}] tensor (V = {vocab_size}), got "
                          f"{bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}")
    if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < bitmask.shape[0]:
        raise ConfigError(f"row must be an int in [0, {bitmask.shape[0]}), got {row!r}")


class XGrammarMatcher:
    """A :class:`~deepinfer_kit.sample.structured.protocols.GrammarMatcher` on xgrammar.

    Built by ``XGrammarBackend.matcher``. xgrammar keeps the whole token history (its rollback
    is unbounded since 0.2.9); this wrapper bounds :meth:`rollback` by ``max_rollback`` and the
    tokens accepted since the last reset, checks ids before xgrammar sees them (it logs a
    warning for each bad one), and after termination fills the stop-only row instead of
    raising as xgrammar does.
    """

    __slots__ = ("_m", "_vocab_size", "_stop_ids", "_max_rollback", "_accepted", "_guard")

    def __init__(self, matcher: Any, *, vocab_size: int, stop_ids: tuple[int, ...],
                 max_rollback: int, accepted: int = 0, guard: TokenGuard | None = None) -> None:
        self._guard = guard
        self._m = matcher
        self._vocab_size = vocab_size
        self._stop_ids = stop_ids
        self._max_rollback = max_rollback
        self._accepted = accepted

    @property
    def max_rollback(self) -> int:
        """The rollback bound this matcher was built with."""
        return self._max_rollback

    @property
    def num_accepted(self) -> int:
        """Tokens accepted since construction or the last reset (minus those rolled back)."""
        return self._accepted

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """See ``GrammarMatcher.fill_bitmask``: O(V / 32) plus xgrammar's mask work."""
        check_bitmask_row(bitmask, row, self._vocab_size)
        if self._m.is_terminated():
            bitmask[row] = bitmask_row(self._stop_ids, self._vocab_size)  # only the stop tokens
            return
        self._m.fill_next_token_bitmask(bitmask, row)
        if self._guard is not None:
            bitmask[row].bitwise_and_(self._guard.allowed)

    def accept_token(self, token: int) -> bool:
        """See ``GrammarMatcher.accept_token``."""
        if not 0 <= token < self._vocab_size or self._m.is_terminated():
            return False
        if self._guard is not None and token in self._guard.banned:
            return False
        if not self._m.accept_token(token):
            return False
        self._accepted += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        """See ``GrammarMatcher.rollback``."""
        limit = min(self._max_rollback, self._accepted)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 0 <= num_tokens <= limit:
            raise InvariantError(
                f"num_tokens must be in [0, {limit}] (max_rollback {self._max_rollback}, "
                f"{self._accepted} tokens accepted), got {num_tokens!r}")
        if num_tokens:
            self._m.rollback(num_tokens)
            self._accepted -= num_tokens

    def is_terminated(self) -> bool:
        """See ``GrammarMatcher.is_terminated``."""
        return bool(self._m.is_terminated())

    def can_terminate(self) -> bool:
        """See ``GrammarMatcher.can_terminate``."""
        return not self._m.is_terminated() and bool(self._m.is_completed())

    def reset(self) -> None:
        """See ``GrammarMatcher.reset``."""
        self._m.reset()
        self._accepted = 0

    def fork(self) -> XGrammarMatcher:
        """See ``GrammarMatcher.fork`` (xgrammar's own fork: a deep copy of the state)."""
        return XGrammarMatcher(self._m.fork(), vocab_size=self._vocab_size, stop_ids=self._stop_ids,
                               max_rollback=self._max_rollback, accepted=self._accepted, guard=self._guard)


if TYPE_CHECKING:
    from deepinfer_kit.sample.structured.protocols import GrammarMatcher

    _check: type[GrammarMatcher] = XGrammarMatcher
