"""Logit edits that come before temperature: repetition / frequency / presence penalties
and the ``min_tokens`` mask of EOS and stop tokens, vectorized over the rows that need them.

Order (same as Hugging Face and vLLM): the repetition penalty over every token seen in the
prompt or the output (positive logits divided by it, negative ones multiplied), then
``frequency_penalty * count + presence_penalty`` subtracted for each token in the output,
then ``-inf`` on ``eos_token_ids[i]`` (unless ``ignore_eos``) and the row's
``stop_token_ids`` while fewer than ``min_tokens`` tokens have been generated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer_kit._staging import host_to_device, to_device
from deepinfer_kit.errors import InvariantError
from deepinfer_kit.sample.records import SamplingBatch

__all__ = ["needs_edits", "apply_penalties"]


def needs_edits(batch: SamplingBatch) -> bool:
    """True when :func:`apply_penalties` would change some row (so the logits need a copy)."""
    params = batch.params
    # lists first: any() over a generator costs more per row than building the list
    return any([p.has_penalties for p in params]) or any(
        [len(out) < p.min_tokens for p, out in zip(params, batch.output_token_ids)])


def _flat_keys(
    rows: list[int], histories: Sequence[Sequence[int]], vocab: int, what: str
) -> torch.Tensor:
    """``row * V + token`` for every token of each row's history (int64, host)."""
    ids = torch.tensor([t for seq in histories for t in seq], dtype=torch.int64)
    lengths = torch.tensor([len(seq) for seq in histories], dtype=torch.int64)
    owner = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lengths)
    bad = ((ids < 0) | (ids >= vocab)).nonzero()
    if bad.numel():
        first = int(bad[0])
        raise InvariantError(
            f"{what}[{int(owner[first])}] holds token {int(ids[first])}, outside [0, {vocab})"
        )
    return owner * vocab + ids


def apply_penalties(x: torch.Tensor, batch: SamplingBatch) -> None:
    """Apply the penalties and the ``min_tokens`` mask to ``x`` in place.

    Args:
        x: ``[N, V]`` float32, contiguous; mutated.
        batch: the ``N`` rows' parameters and histories.

    Raises:
        InvariantError: a prompt or output token id outside ``[0, V)``.
    """
    vocab = x.shape[1]
    flat = x.view(-1)
    device = x.device
    params = batch.params

    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep_rows:
        seen = [list(batch.prompt_token_ids[i]) + list(batch.output_token_ids[i]) for i in rep_rows]
        keys = host_to_device(torch.unique(_flat_keys(rep_rows, seen, vocab, "prompt/output_token_ids")), device)
        factor = to_device([p.repetition_penalty for p in params], torch.float32, device)
        row_factor = factor[keys // vocab]
        vals = flat[keys]
        flat[keys] = torch.where(vals > 0, vals / row_factor, vals * row_factor)

    add_rows = [
        i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    ]
    if add_rows:
        outs = [batch.output_token_ids[i] for i in add_rows]
        keys, counts = torch.unique(
            _flat_keys(add_rows, outs, vocab, "output_token_ids"), return_counts=True
        )
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)
        pres = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)
        row = keys // vocab
        delta = freq[row] * counts.to(torch.float32) + pres[row]
        keys = host_to_device(keys, device)
        flat[keys] = flat[keys] - host_to_device(delta, device)

    masked: list[int] = []
    for i, p in enumerate(params):
        if len(batch.output_token_ids[i]) >= p.min_tokens:
            continue
        banned = set(p.stop_token_ids)
        eos = batch.eos_token_ids[i]
        if eos is not None and not p.ignore_eos:
            banned.add(eos)
        masked.extend(i * vocab + t for t in sorted(banned) if t < vocab)
    if masked:
        # index_fill_ takes the value as a kernel argument: an indexed assignment of a
        # Python float copies a CPU scalar tensor to the device, a synchronising copy
        flat.index_fill_(0, to_device(masked, torch.int64, device), float("-inf"))
