"""Contracts of structured outputs: a GrammarBackend compiles a spec, a GrammarMatcher follows
one request's tokens through it and writes the bitmask of the tokens allowed next.

Bitmask layout (xgrammar's, shared by every backend): an int32 host tensor ``[N, W]`` with
``W = ceil(V / 32)``; token ``t`` is allowed in row ``r`` iff bit ``t % 32`` of word
``bitmask[r, t // 32]`` is set (bit 31 is the sign bit of the int32). Bits at ``t >= V`` are
never read.
"""

from __future__ import annotations

from typing import Protocol

import torch

from deepinfer_kit.sample.structured.params import StructuredOutputsParams

__all__ = ["CompiledGrammar", "GrammarMatcher", "GrammarBackend"]


class CompiledGrammar(Protocol):
    """A spec compiled for one backend and tokenizer; opaque, immutable, shareable between
    threads and matchers. Only the backend that built it can make a matcher of it."""

    @property
    def spec(self) -> StructuredOutputsParams:
        """The spec it was compiled from."""
        ...


class GrammarMatcher(Protocol):
    """One request's position in its grammar. Not thread-safe: one owner at a time (the
    engine thread); independent matchers may run in different threads.

    The stop tokens (the backend's EOS ids) are allowed exactly where the text accepted so
    far is a complete match; accepting one terminates the matcher.
    """

    @property
    def max_rollback(self) -> int:
        """How many of the most recently accepted tokens :meth:`rollback` can undo (the
        value the matcher was built with)."""
        ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row ``row`` of ``bitmask`` (int32, on the host,
        ``[N, ceil(V / 32)]``, layout in the module doc); other rows are untouched, the
        matcher is not. Once terminated, the row allows the stop tokens only.

        Raises:
            ConfigError: ``bitmask`` is not a host int32 ``[N, ceil(V / 32)]`` tensor or
                ``row`` is outside ``[0, N)``.
        """
        ...

    def accept_token(self, token: int) -> bool:
        """Advance by ``token`` if the grammar allows it here (mutates the matcher).

        Returns:
            True when accepted; False (the state unchanged) for a token the grammar does not
            allow here, an id outside ``[0, V)``, or any token after termination.
        """
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (a stop token included: the matcher is
        live again), e.g. a speculative draft's rejected tail. ``0`` is a no-op.

        Raises:
            InvariantError: ``num_tokens`` is negative or exceeds ``min(max_rollback,
                tokens accepted since the last reset)``; the state is unchanged.
        """
        ...

    def is_terminated(self) -> bool:
        """Whether a stop token was accepted (generation over)."""
        ...

    def can_terminate(self) -> bool:
        """Whether the text accepted so far is a complete match (a stop token is allowed
        now). False once terminated."""
        ...

    def reset(self) -> None:
        """Return to the grammar's start (nothing accepted), e.g. for a preempted request
        recomputed from its prompt."""
        ...

    def fork(self) -> GrammarMatcher:
        """An independent matcher at the same state and with the same rollback history (for
        n > 1 children); advancing either leaves the other as it was."""
        ...


class GrammarBackend(Protocol):
    """Compiles specs for one tokenizer and vocabulary, and makes matchers of them."""

    @property
    def vocab_size(self) -> int:
        """``V``: the bitmask width in tokens (the model's logits width)."""
        ...

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """Compile ``spec`` (may take from microseconds, cached, to seconds: call it off the
        engine thread). Safe to call from several threads at once.

        Raises:
            StructuredOutputError: an invalid or unsupported spec, naming the spec field.
        """
        ...

    def matcher(self, grammar: CompiledGrammar, *, max_rollback: int) -> GrammarMatcher:
        """A fresh matcher at the start of ``grammar`` (cheap; call it per request) that can
        roll back up to ``max_rollback`` tokens (the speculative draft length, or 0).

        Raises:
            ConfigError: ``max_rollback`` is negative, or ``grammar`` came from another
                backend.
        """
        ...
