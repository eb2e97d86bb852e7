"""XGrammarMatcher: the GrammarMatcher over an ``xgrammar.GrammarMatcher``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from deepinfer_kit.errors import ConfigError, InvariantError

__all__ = ["XGrammarMatcher", "check_bitmask_row"]


def check_bitmask_row(bitmask: torch.Tensor, row: int, vocab_size: int) -> None:
    """Raise ConfigError unless ``bitmask`` is a host int32 ``[N, ceil(V / 32)]`` tensor and
    ``row`` is in ``[0, N)``."""
    words = (vocab_size + 31) // 32
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2 \
            or bitmask.shape[1] != words:
        raise ConfigError(f"bitmask must be a host int32 [N, {words}] tensor (V = {vocab_size}), got "
                          f"{bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}")
    if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < bitmask.shape[0]:
        raise ConfigError(f"row must be an int in [0, {bitmask.shape[0]}), got {row!r}")


def _stop_only_words(stop_ids: tuple[int, ...], words: int) -> list[int]:
    """The int32 words of a row allowing only ``stop_ids``."""
    row = [0] * words
    for t in stop_ids:
        row[t // 32] |= 1 << (t % 32)
    return [w - (1 << 32) if w >= 1 << 31 else w for w in row]


class XGrammarMatcher:
    """A :class:`~deepinfer_kit.sample.structured.protocols.GrammarMatcher` on xgrammar.

    Built by ``XGrammarBackend.matcher``. xgrammar keeps the whole token history (its rollback
    is unbounded since 0.2.9); this wrapper bounds :meth:`rollback` by ``max_rollback`` and the
    tokens accepted since the last reset, checks ids before xgrammar sees them (it logs a
    warning for each bad one), and after termination fills the stop-only row instead of
    raising as xgrammar does.
    """

    __slots__ = ("_m", "_vocab_size", "_stop_ids", "_max_rollback", "_accepted")

    def __init__(self, matcher: Any, *, vocab_size: int, stop_ids: tuple[int, ...],
                 max_rollback: int, accepted: int = 0) -> None:
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
            words = _stop_only_words(self._stop_ids, bitmask.shape[1])
            bitmask[row] = torch.tensor(words, dtype=torch.int32)
            return
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token: int) -> bool:
        """See ``GrammarMatcher.accept_token``."""
        if not 0 <= token < self._vocab_size or self._m.is_terminated():
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
                               max_rollback=self._max_rollback, accepted=self._accepted)


if TYPE_CHECKING:
    from deepinfer_kit.sample.structured.protocols import GrammarMatcher

    _check: type[GrammarMatcher] = XGrammarMatcher
