"""RequestBuilder: turns what a user passes to ``add_request`` into a validated
``Request`` — the engine's API edge, with every rule of it in one place."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.request import Request
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sample.structured.check import GrammarCheck

if TYPE_CHECKING:
    from deepinfer_kit.models.tokenizer import Tokenizer

__all__ = ["RequestBuilder"]


class RequestBuilder:
    """Validates prompts and parameters and builds requests (never queues them).

    Args:
        tokenizer: encodes text prompts; ``None`` for token ids only.
        vocab_size: prompt token ids must lie in ``[0, vocab_size)``.
        eos_token_id: the model's EOS id, stamped on every request.
        extra_eos_token_ids: further EOS ids, added as stop ids unless ``ignore_eos``.
        max_logprobs: the most ``logprobs`` a request may ask for (``-1``: no cap).
        never_fits: the scheduler's rule for requests that could never run.
        tokenizer_note: why there is no tokenizer, quoted when a text prompt arrives.
        max_model_len: the scheduler's; ``truncate_prompt_tokens=-1`` keeps the last
            ``max_model_len - 1`` tokens and a larger count is refused (``None``: -1 is
            refused, any count accepted).
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        eos_token_id: int | None,
        extra_eos_token_ids: Sequence[int],
        max_logprobs: int,
        never_fits: Callable[[Request], str | None],
        tokenizer_note: str | None = None,
        max_model_len: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.extra_eos_token_ids = tuple(extra_eos_token_ids)
        self.max_logprobs = max_logprobs
        self.never_fits = never_fits
        self.tokenizer_note = tokenizer_note
        self.max_model_len = max_model_len
        stops = ((eos_token_id,) if eos_token_id is not None else ()) + self.extra_eos_token_ids
        self.grammar = GrammarCheck(tokenizer, vocab_size, stops)

    def encode(self, prompt: str | Sequence[int]) -> tuple[list[int], str | None]:
        """Token ids (and text) of a prompt, validated (length rules are the scheduler's).

        Raises:
            ConfigError: empty prompt, ids outside the vocabulary, or text without a
                tokenizer.
        """
        if isinstance(prompt, str):
            if self.tokenizer is None:
                note = f" ({self.tokenizer_note})" if self.tokenizer_note else ""
                raise ConfigError(
                    f"prompt is text but the engine has no tokenizer{note}; pass token ids"
                )
            text: str | None = prompt
            raw: Sequence[object] = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):
            raise ConfigError(
                f"prompt must be text or a sequence of token ids, got {type(prompt).__name__}"
            )
        else:
            text = None
            raw = prompt
        if not raw:
            raise ConfigError(f"prompt must not be empty, got {prompt!r}")
        ids: list[int] = []
        for tok in raw:
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < self.vocab_size:
                raise ConfigError(
                    f"prompt token ids must be ints in [0, {self.vocab_size}), got {tok!r}"
                )
            ids.append(tok)
        return ids, text

    def build(
        self,
        sid: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None,
        priority: int,
        cache_context: Any,
    ) -> Request:
        """A validated, not yet queued request under scheduler id ``sid``.

        ``truncate_prompt_tokens`` keeps the prompt's last tokens (the text stays as given;
        ``-1``: as many as ``max_model_len`` leaves room for).

        Raises:
            ConfigError: bad prompt (:meth:`encode`), params not SamplingParams,
                ``logprobs`` or ``prompt_logprobs`` above ``max_logprobs``,
                ``truncate_prompt_tokens`` above ``max_model_len``, a non-int ``priority``, or a request
                ``never_fits`` refuses (the message names the limit).
            StructuredOutputError: (a ConfigError) ``structured_outputs`` that does not
                compile within its time limit (:class:`GrammarCheck`).
        """
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ConfigError(f"params must be SamplingParams, got {type(params).__name__}")
        params = self._logprob_counts(params)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ConfigError(f"priority must be an int, got {priority!r}")
        ids, text = self.encode(prompt)
        params = self._logit_fields(params)
        if params.structured_outputs is not None:
            self.grammar.check(params.structured_outputs)
        if params.truncate_prompt_tokens is not None:
            ids = ids[-self._truncation(params.truncate_prompt_tokens):]  # vLLM keeps the end
        if self.extra_eos_token_ids and not params.ignore_eos:
            extra = tuple(t for t in self.extra_eos_token_ids if t not in params.stop_token_ids)
            params = attrs.evolve(params, stop_token_ids=params.stop_token_ids + extra)
        request = Request(
            request_id=sid,
            prompt_token_ids=ids,
            params=params,
            arrival_time=time.monotonic(),
            eos_token_id=self.eos_token_id,
            priority=priority,
            prompt_text=text,
            cache_context=cache_context,
        )
        reason = self.never_fits(request)
        if reason is not None:
            raise ConfigError(f"request can never run: {reason}")
        return request

    def _truncation(self, asked: int) -> int:
        """How many prompt tokens ``truncate_prompt_tokens=asked`` keeps: ``asked``, or for
        ``-1`` ``max_model_len - 1`` (vLLM keeps ``max_model_len``; here a prompt must
        leave room for one output token, see the scheduler's ``never_fits``).

        Raises:
            ConfigError: ``asked`` above ``max_model_len`` (as vLLM), or ``-1`` without one.
        """
        limit = self.max_model_len
        if asked == -1:
            if limit is None:
                raise ConfigError(
                    "truncate_prompt_tokens=-1 needs the engine's max_model_len; this engine "
                    "was built without one, got -1"
                )
            return max(limit - 1, 1)
        if limit is not None and asked > limit:
            raise ConfigError(
                f"truncate_prompt_tokens must be <= max_model_len ({limit}) or -1, got {asked}"
            )
        return asked

    def _logprob_counts(self, params: SamplingParams) -> SamplingParams:
        """``params`` with a ``logprobs`` / ``prompt_logprobs`` of ``-1`` turned into the
        vocabulary size (vLLM's rule, so the sampler asks for ``K = V``), after checking
        both against ``max_logprobs`` (``-1``: no cap).

        Raises:
            ConfigError: a count above ``max_logprobs`` (naming the field and value).
        """
        cap = self.vocab_size if self.max_logprobs == -1 else self.max_logprobs
        counts: list[int | None] = []
        for name, asked in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
            count = self.vocab_size if asked == -1 else asked
            if count is not None and count > cap:
                limit = f"-1: the vocabulary size, {cap}" if self.max_logprobs == -1 else str(cap)
                every = f" (the whole vocabulary, {count} tokens)" if asked == -1 else ""
                raise ConfigError(f"{name} must be <= max_logprobs ({limit}), got {asked}{every}")
            counts.append(count)
        if -1 not in (params.logprobs, params.prompt_logprobs):
            return params
        return attrs.evolve(params, logprobs=counts[0], prompt_logprobs=counts[1])

    def _logit_fields(self, params: SamplingParams) -> SamplingParams:
        """``params`` with ``bad_words`` tokenized into ``bad_words_token_ids``, after
        checking every token id of the logit fields against the vocabulary.

        Raises:
            ConfigError: a token id outside ``[0, vocab_size)``, or bad words without a
                tokenizer.
        """
        if params.bad_words:
            if self.tokenizer is None:
                raise ConfigError(
                    f"bad_words need a tokenizer, the engine has none; got "
                    f"{list(params.bad_words)!r} (pass bad_words_token_ids instead)"
                )
            seqs = bad_word_sequences(self.tokenizer, params.bad_words)
            known = set(params.bad_words_token_ids)
            extra = tuple(seq for seq in seqs if seq not in known)
            params = attrs.evolve(params, bad_words_token_ids=params.bad_words_token_ids + extra)
        checks: list[tuple[str, Sequence[int]]] = [
            ("logit_bias", list(params.logit_bias or ())),
            ("allowed_token_ids", params.allowed_token_ids or ()),
            ("bad_words_token_ids", [t for seq in params.bad_words_token_ids for t in seq]),
        ]
        for name, tokens in checks:
            for token in tokens:
                if token >= self.vocab_size:
                    raise ConfigError(
                        f"{name} must hold token ids in [0, {self.vocab_size}), got {token}"
                    )
        return params


def bad_word_sequences(tokenizer: Tokenizer, words: Sequence[str]) -> list[tuple[int, ...]]:
    """The token sequences of ``words`` (vLLM's rule): each word with its leading spaces
    stripped, then with one leading space when that spelling starts with a different
    token and has as many tokens. Tokens the tokenizer adds around any text (those it
    adds to ``""``) are removed. Called by ``add_request``; O(total text length)."""
    around = tokenizer.encode("")

    def encode(text: str) -> tuple[int, ...]:
        ids = tokenizer.encode(text)
        if around and ids[: len(around)] == around:
            ids = ids[len(around) :]
        elif around and ids[-len(around) :] == around:
            ids = ids[: -len(around)]
        return tuple(ids)

    out: list[tuple[int, ...]] = []
    for word in words:
        plain = encode(word.lstrip())
        if plain:
            out.append(plain)
        spaced = encode(" " + word.lstrip())
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out
