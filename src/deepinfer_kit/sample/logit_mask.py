"""The logit edits of ``logit_bias``, ``allowed_token_ids`` and bad words, as one batched
stage that runs on the raw float32 logits of the sampling rows before the sampler (so
before penalties, ``min_tokens`` and temperature, and under greedy as well).

The host turns a step's rows into index lists once (a loop over rows and their words,
never over the vocabulary), packs them into one int64 tensor and copies it to the device
in one transfer; the device applies three scatters. Region order of the packed tensor:
``bias_keys [B] | bias_bits [B] | banned_keys [K] | allowed_rows [A] | allowed_keys [M]``,
where a key is ``row * V + token`` (``allowed_keys`` use the row's rank among the allowed
rows) and ``bias_bits`` are the float32 biases' bit patterns. Each row's edits depend on
its own parameters and history only, so the stage is batch-invariant.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import attrs
import torch

from deepinfer_kit.errors import InvariantError
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sample.plan import same_objects
from deepinfer_kit.sample.records import SamplingBatch

__all__ = ["LogitMask", "MaskMemo", "banned_tokens", "build_logit_mask", "apply_logit_mask", "edit_logits"]


@attrs.frozen(slots=True)
class LogitMask:
    """A step's edits, packed on the host (see the module doc for the layout).

    Attributes:
        packed: int64 host tensor (pinned when asked).
        num_bias: ``B``; num_banned: ``K``; num_allowed_rows: ``A``; num_allowed: ``M``.
        vocab: ``V``, the logits' width the keys were built for.
    """

    packed: torch.Tensor
    num_bias: int
    num_banned: int
    num_allowed_rows: int
    num_allowed: int
    vocab: int


def banned_tokens(words: Sequence[Sequence[int]], history: Sequence[int]) -> set[int]:
    """Tokens a row must not draw next: the last token of every word whose other tokens
    end ``history`` (the tokens generated so far); a one-token word is always banned.
    O(sum of word lengths)."""
    out: set[int] = set()
    for word in words:
        head = len(word) - 1
        if head == 0 or (head <= len(history) and tuple(history[len(history) - head :]) == tuple(word[:head])):
            out.add(word[-1])
    return out


def _bits(value: float) -> int:
    """The float32 bit pattern of ``value`` as a signed int32."""
    return int(struct.unpack("<i", struct.pack("<f", value))[0])


def build_logit_mask(
    params: Sequence[SamplingParams],
    histories: Sequence[Sequence[int]],
    vocab: int,
    *,
    pin_memory: bool = False,
) -> LogitMask | None:
    """Pack the edits of ``N`` rows; ``None`` when no row has any.

    Called on the host once per step, after the in-flight tokens are known (a bad word's
    prefix may end with one). ``histories[i]`` is row ``i``'s generated tokens before its
    draw. O(sum over rows of their bias entries, allowed ids and bad-word tokens).

    Raises:
        InvariantError: a token id outside ``[0, vocab)`` (``add_request`` rejects them,
            so this is a caller bug).
    """
    if not any([p.has_logit_mask for p in params]):  # the usual batch: one quick pass
        return None
    bias_keys: list[int] = []
    bias_bits: list[int] = []
    banned: list[int] = []
    allowed_rows: list[int] = []
    allowed: list[int] = []
    for i, p in enumerate(params):
        if not p.has_logit_mask:
            continue
        base = i * vocab
        for token, bias in sorted((p.logit_bias or {}).items()):
            _check(token, vocab, "logit_bias")
            bias_keys.append(base + token)
            bias_bits.append(_bits(bias))
        if p.bad_words_token_ids:
            for token in sorted(banned_tokens(p.bad_words_token_ids, histories[i])):
                _check(token, vocab, "bad_words_token_ids")
                banned.append(base + token)
        if p.allowed_token_ids is not None:
            rank = len(allowed_rows) * vocab
            allowed_rows.append(i)
            for token in p.allowed_token_ids:
                _check(token, vocab, "allowed_token_ids")
                allowed.append(rank + token)
    if not (bias_keys or banned or allowed_rows):
        return None
    values = [*bias_keys, *bias_bits, *banned, *allowed_rows, *allowed]
    return LogitMask(
        packed=torch.tensor(values, dtype=torch.int64, pin_memory=pin_memory),
        num_bias=len(bias_keys),
        num_banned=len(banned),
        num_allowed_rows=len(allowed_rows),
        num_allowed=len(allowed),
        vocab=vocab,
    )


def _check(token: int, vocab: int, what: str) -> None:
    if not 0 <= token < vocab:
        raise InvariantError(f"{what} holds token {token}, outside [0, {vocab})")


def apply_logit_mask(x: torch.Tensor, mask: LogitMask) -> None:
    """Apply ``mask`` to ``x`` in place: biases added, banned tokens and tokens outside a
    row's allowed set set to ``-inf``.

    Args:
        x: ``[N, V]`` float32 contiguous logits (any device); mutated.
        mask: built for these ``N`` rows and this ``V``; copied to ``x``'s device in one
            transfer (non-blocking from pinned memory).

    Raises:
        InvariantError: ``x`` is not ``[N, mask.vocab]`` contiguous float32.
    """
    vocab = mask.vocab
    if x.dim() != 2 or x.shape[1] != vocab or x.dtype != torch.float32 or not x.is_contiguous():
        raise InvariantError(
            f"logit mask needs contiguous float32 [N, {vocab}] logits, got {x.dtype} "
            f"{tuple(x.shape)}"
        )
    dev = mask.packed.to(x.device, non_blocking=mask.packed.is_pinned())
    b, k, a, m = mask.num_bias, mask.num_banned, mask.num_allowed_rows, mask.num_allowed
    keys, bits, ban, rows, keep_keys = torch.split(dev, [b, b, k, a, m])
    flat = x.view(-1)
    if b:
        flat.index_add_(0, keys, bits.to(torch.int32).view(torch.float32))
    if k:
        flat[ban] = float("-inf")
    if a:
        keep = torch.zeros(a * vocab, dtype=torch.bool, device=x.device)
        keep[keep_keys] = True
        sub = x.index_select(0, rows).masked_fill_(~keep.view(a, vocab), float("-inf"))
        x.index_copy_(0, rows, sub)


class MaskMemo:
    """:func:`edit_logits` that remembers the last params with no logit edit in any row
    (no ``logit_bias``, allowed ids or bad words), and skips even checking the rows while
    a round's params are those very objects, in order (a decode round after a decode round
    of the same sequences). One memo per runner; its calls do not overlap."""

    __slots__ = ("_plain",)

    def __init__(self) -> None:
        self._plain: list[SamplingParams] = []

    def edit(self, x: torch.Tensor, batch: SamplingBatch, *, pin_memory: bool) -> torch.Tensor:
        """:func:`edit_logits` of ``x`` and ``batch`` (same contract, same result)."""
        params = batch.params
        if same_objects(self._plain, params):
            return x
        if not any([p.has_logit_mask for p in params]):
            self._plain = list(params)
            return x
        return edit_logits(x, batch, pin_memory=pin_memory)


def edit_logits(x: torch.Tensor, batch: SamplingBatch, *, pin_memory: bool) -> torch.Tensor:
    """Apply the edits of ``batch``'s rows to ``x`` in place (the runner calls it once per
    step, before the sampler, after the rows' histories hold the in-flight tokens: a bad
    word's prefix may end with one — so this is a second small host-to-device copy beside
    the step's packed inputs, built when the step executes).

    Returns the logits before the edit, for the logprobs (vLLM reports raw ones): ``x``
    itself when nothing changed or no row asked for logprobs, else an unedited copy.

    Args:
        x: ``[N, V]`` float32 contiguous logits of the ``N`` rows; mutated.
        batch: the rows' parameters and generated tokens.

    Raises:
        InvariantError: as :func:`build_logit_mask` / :func:`apply_logit_mask`.
    """
    mask = build_logit_mask(batch.params, batch.output_token_ids, x.shape[1], pin_memory=pin_memory)
    if mask is None:
        return x
    raw = x.clone() if batch.max_logprobs >= 0 else x
    apply_logit_mask(x, mask)
    return raw
