"""SamplingParams: the per-request decoding parameters, validated at construction."""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from typing import Any

import attrs

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sample.structured.params import StructuredOutputsParams

__all__ = ["RequestOutputKind", "SamplingParams"]

_SEED_LIMIT = 2**63
_MIN_TEMPERATURE = 0.01  # vLLM's floor: a positive temperature below it is raised to it


def _to_int_tuple(value: Iterable[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)):
        raise ConfigError(f"stop_token_ids must be a sequence of ints, got {value!r}")
    return tuple(value)


def _to_str_tuple(value: str | Iterable[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, bytes) or not isinstance(value, Iterable):
        raise ConfigError(f"stop must be a str or a list of str, got {value!r}")
    return tuple(value)


class RequestOutputKind(enum.Enum):
    """What ``Engine.step()`` reports for a request while it runs (vLLM's names).

    CUMULATIVE: every round that gave it tokens, its whole output so far; DELTA: every
    such round, only what is new since the last report; FINAL_ONLY: nothing until it
    finished, then its whole output.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _floor_temperature(value: Any) -> Any:
    """A positive temperature below 0.01 raised to 0.01 (as vLLM does: tiny values make
    ``logits / T`` overflow); anything else unchanged (validated afterwards)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < _MIN_TEMPERATURE:
        return _MIN_TEMPERATURE
    return value


def _to_bias(value: Any) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError(f"logit_bias must be a dict of token id -> bias, got {value!r}")
    return dict(value)


def _to_opt_int_tuple(value: Iterable[int] | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ConfigError(f"allowed_token_ids must be a list of ints, got {value!r}")
    return tuple(value)


def _to_words(value: Iterable[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ConfigError(f"bad_words must be a list of str, got {value!r}")
    return tuple(value)


def _to_sequences(value: Iterable[Iterable[int]] | None) -> tuple[tuple[int, ...], ...]:
    if value is None:
        return ()
    try:
        return tuple(tuple(seq) for seq in value)
    except TypeError:
        raise ConfigError(
            f"bad_words_token_ids must be a list of token id lists, got {value!r}"
        ) from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require_int(name: str, value: Any) -> None:
    if not _is_int(value):
        raise ConfigError(f"{name} must be an int, got {value!r}")


def _require_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be finite, got {value!r}")
    return float(value)


def _to_structured(value: object) -> StructuredOutputsParams | None:
    """``structured_outputs``: a :class:`StructuredOutputsParams`, a dict of its fields
    (as a JSON body carries it) or ``None``."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        return StructuredOutputsParams(**value)
    raise ConfigError(
        f"structured_outputs must be a StructuredOutputsParams or a dict of its fields, got {value!r}"
    )


@attrs.frozen(slots=True)
class SamplingParams:
    """How to pick the tokens of one request.

    Every field is validated when the object is built; a bad value raises
    :class:`~deepinfer_kit.errors.ConfigError` naming the field and the value.

    Attributes:
        n: completions to generate for the prompt (``n > 1`` forks the request after its
            prompt is computed; the children share the prompt's KV blocks). ``n > 1`` with
            ``temperature=0`` is refused, as vLLM refuses it (the completions would be
            identical).
        temperature: logits are divided by it; ``0`` means greedy (argmax). A value in
            ``(0, 0.01)`` is raised to ``0.01`` (vLLM's rule). Values above 2 are accepted
            (vLLM refuses them).
        top_k: keep the ``k`` most likely tokens; ``0`` or ``-1`` disables it.
        top_p: keep the smallest set of tokens whose probability reaches ``top_p``;
            in ``(0, 1]``, ``1`` disables it.
        min_p: drop tokens whose probability is below ``min_p`` times the top token's;
            in ``[0, 1]``, ``0`` disables it.
        presence_penalty: subtracted once from the logit of every token already generated;
            in ``[-2, 2]``.
        frequency_penalty: subtracted per occurrence of each generated token; in ``[-2, 2]``.
        repetition_penalty: divides positive (multiplies negative) logits of tokens seen in
            the prompt or the output; ``> 0``, ``1`` disables it.
        seed: makes sampling reproducible and batch-invariant; ``None`` draws from the
            engine's generator. In ``[0, 2**63)``.
        max_tokens: generated tokens at most (finish reason ``length``); ``>= 1``, or
            ``None``: until the context is full (``max_model_len``).
        min_tokens: EOS and stop tokens are masked until this many tokens are generated.
        stop_token_ids: generation stops (reason ``stop``) after any of these tokens.
        ignore_eos: keep generating past the model's EOS token.
        logprobs: when set, return the chosen token's logprob and the top-``logprobs``
            alternatives at each step; ``0`` returns only the chosen token's, ``-1`` the
            whole vocabulary (vLLM's meaning; allowed only when the engine's
            ``max_logprobs`` is ``-1`` or at least the vocabulary size).
        stop: strings that end the generation (reason ``stop``, ``stop_reason`` the
            string) as soon as the detokenised output contains one; the text is cut
            before it. A str or a list of non-empty str; needs ``detokenize``.
        include_stop_str_in_output: keep the stop string (and the text of a stop
            token) at the end of the text.
        skip_special_tokens: leave special tokens out of the text.
        spaces_between_special_tokens: accepted for vLLM compatibility (a bool, default
            True). The text is always the tokenizer's own decode of the tokens, which is
            what vLLM gives with the default; ``False`` changes nothing here. (vLLM's
            fast detokenizer then writes an added token that follows another one as its
            bare content, which differs only for decoders that join tokens with spaces,
            such as WordPiece; byte-level BPE and SentencePiece decoders insert none.)
        detokenize: produce text (``False``: ``text`` stays empty; token ids only).
        truncate_prompt_tokens: keep only the last ``k`` prompt tokens (``>= 1``, at most
            the engine's ``max_model_len``); ``-1``: the last ``max_model_len - 1`` (the
            most a prompt may hold and still leave room for one output token).
        output_kind: what is reported while the request runs (see
            :class:`RequestOutputKind`). ``None`` (the default) leaves it to the caller:
            :class:`~deepinfer_kit.serve.AsyncLLM` streams CUMULATIVE outputs (vLLM's
            default), ``Engine.step()`` reports the request once finished (FINAL_ONLY);
            ``LLM.generate`` always uses FINAL_ONLY.
        prompt_logprobs: when set, the logprob of every prompt token after the first
            (given the tokens before it) and the top-``prompt_logprobs`` alternatives, in
            ``RequestOutput.prompt_logprobs``; ``-1``: the whole vocabulary (capped by
            ``max_logprobs`` like ``logprobs``); such a request takes no prefix-cache hits.
        logit_bias: token id -> bias in ``[-100, 100]`` added to that token's raw logit
            (before penalties and temperature), or ``None``.
        allowed_token_ids: only these tokens may be drawn (every other logit is
            ``-inf``); a non-empty list, or ``None`` for all.
        bad_words: words never to generate: each is tokenized (as written and with a
            leading space) at ``add_request``; a word's last token is banned whenever the
            generated tokens end with the word's other tokens (a one-token word is always
            banned). Needs a tokenizer.
        bad_words_token_ids: the token sequences banned that way; ``add_request`` adds
            those of ``bad_words`` (the field may also be given directly, without a
            tokenizer).

        structured_outputs: constrain the output to a JSON schema, a regex, a choice
            or a grammar (:class:`~deepinfer_kit.sample.structured.StructuredOutputsParams`,
            or a dict of its fields); the engine masks every token the grammar does not
            allow at each step, EOS included until the grammar may end
            (docs/structured_outputs.md). Needs the ``structured`` extra (xgrammar).

    Token ids of ``logit_bias`` / ``allowed_token_ids`` / ``bad_words_token_ids`` are
    checked against the model's vocabulary at ``add_request``.
    """

    n: int = 1
    temperature: float = attrs.field(default=1.0, converter=_floor_temperature)
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_to_int_tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    stop: tuple[str, ...] = attrs.field(default=(), converter=_to_str_tuple)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = attrs.field(
        default=None, converter=_to_bias, hash=False
    )
    allowed_token_ids: tuple[int, ...] | None = attrs.field(
        default=None, converter=_to_opt_int_tuple
    )
    bad_words: tuple[str, ...] = attrs.field(default=(), converter=_to_words)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = attrs.field(
        default=(), converter=_to_sequences
    )
    structured_outputs: StructuredOutputsParams | None = attrs.field(
        default=None, converter=_to_structured
    )

    def __attrs_post_init__(self) -> None:
        _require_int("n", self.n)
        if self.n < 1:
            raise ConfigError(f"n must be >= 1, got {self.n}")
        temperature = _require_float("temperature", self.temperature)
        if temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if temperature == 0.0 and self.n > 1:
            raise ConfigError(
                f"n must be 1 when using greedy sampling (temperature=0), got n={self.n}"
            )
        _require_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ConfigError(f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k}")
        top_p = _require_float("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        min_p = _require_float("min_p", self.min_p)
        if not 0.0 <= min_p <= 1.0:
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _require_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ConfigError(f"{name} must be in [-2, 2], got {value}")
        repetition = _require_float("repetition_penalty", self.repetition_penalty)
        if repetition <= 0:
            raise ConfigError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None:
            _require_int("seed", self.seed)
            if not 0 <= self.seed < _SEED_LIMIT:
                raise ConfigError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.max_tokens is not None:
            _require_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        _require_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ConfigError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ConfigError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        for token in self.stop_token_ids:
            if not _is_int(token) or token < 0:
                raise ConfigError(f"stop_token_ids must hold token ids >= 0, got {token!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            _require_int("logprobs", self.logprobs)
            if self.logprobs < -1:
                raise ConfigError(f"logprobs must be >= 0 or -1 (all), got {self.logprobs}")
        self._check_output_fields()
        self._check_logit_fields()

    def _check_logit_fields(self) -> None:
        if self.prompt_logprobs is not None:
            _require_int("prompt_logprobs", self.prompt_logprobs)
            if self.prompt_logprobs < -1:
                raise ConfigError(
                    f"prompt_logprobs must be >= 0 or -1 (all), got {self.prompt_logprobs}"
                )
        for token, bias in (self.logit_bias or {}).items():
            if not _is_int(token) or token < 0:
                raise ConfigError(f"logit_bias keys must be token ids >= 0, got {token!r}")
            value = _require_float(f"logit_bias[{token}]", bias)
            if not -100.0 <= value <= 100.0:
                raise ConfigError(f"logit_bias[{token}] must be in [-100, 100], got {bias!r}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ConfigError("allowed_token_ids must not be empty, got []")
            for token in self.allowed_token_ids:
                if not _is_int(token) or token < 0:
                    raise ConfigError(
                        f"allowed_token_ids must hold token ids >= 0, got {token!r}"
                    )
        for word in self.bad_words:
            if not isinstance(word, str) or not word.strip():
                raise ConfigError(f"bad_words must hold non-blank strings, got {word!r}")
        for seq in self.bad_words_token_ids:
            if not seq or any(not _is_int(t) or t < 0 for t in seq):
                raise ConfigError(
                    f"bad_words_token_ids must hold non-empty lists of token ids >= 0, "
                    f"got {list(seq)!r}"
                )

    def _check_output_fields(self) -> None:
        for stop in self.stop:
            if not isinstance(stop, str) or not stop:
                raise ConfigError(f"stop must hold non-empty strings, got {stop!r}")
        for name in (
            "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
            "detokenize",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.stop and not self.detokenize:
            raise ConfigError(f"stop strings need detokenize=True, got stop={list(self.stop)!r}")
        if self.truncate_prompt_tokens is not None:
            _require_int("truncate_prompt_tokens", self.truncate_prompt_tokens)
            if self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1:
                raise ConfigError(
                    f"truncate_prompt_tokens must be >= 1 or -1 (max_model_len), got "
                    f"{self.truncate_prompt_tokens}"
                )
        if self.output_kind is not None and not isinstance(self.output_kind, RequestOutputKind):
            raise ConfigError(
                f"output_kind must be a RequestOutputKind, got {self.output_kind!r}"
            )

    def clone(self) -> SamplingParams:
        """A copy of these parameters (vLLM's ``SamplingParams.clone``). The record is
        frozen, so the copy is equal to this one; its ``logit_bias`` dict is a new dict."""
        return attrs.evolve(self, logit_bias=self.logit_bias)

    @property
    def is_greedy(self) -> bool:
        """True when the token is the argmax (temperature 0, or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def uses_top_k(self) -> bool:
        """True when top-k filtering is active (``top_k >= 1``)."""
        return self.top_k >= 1

    @property
    def has_logit_mask(self) -> bool:
        """True when ``logit_bias``, ``allowed_token_ids`` or bad words edit the logits."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(
            self.bad_words_token_ids
        )

    @property
    def has_penalties(self) -> bool:
        """True when any of the three penalties changes the logits."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
