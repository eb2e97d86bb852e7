"""Token bitmasks: allocate the host bitmask a GrammarMatcher fills, and apply it to logits on
their device (torch only: bits unpacked by shifts, no host read, no loop over rows)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from deepinfer_kit.errors import ConfigError

__all__ = ["allocate_bitmask", "apply_bitmask", "bitmask_words", "bitmask_row"]


def bitmask_words(vocab_size: int) -> int:
    """``ceil(V / 32)``: int32 words per bitmask row."""
    return (vocab_size + 31) // 32


def bitmask_row(allowed: Iterable[int], vocab_size: int) -> torch.Tensor:
    """One host int32 bitmask row ``[ceil(V / 32)]`` allowing exactly the ids in ``allowed``
    (each in ``[0, V)``): bit ``t % 32`` of word ``t // 32``, words as signed int32."""
    words = [0] * bitmask_words(vocab_size)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def allocate_bitmask(num_rows: int, vocab_size: int, *, pin_memory: bool = False) -> torch.Tensor:
    """A host int32 bitmask ``[num_rows, ceil(V / 32)]`` of all ones (every token allowed).

    ``pin_memory``: page-locked, so its copy to a GPU does not stall the host.

    Raises:
        ConfigError: ``num_rows`` < 0 or ``vocab_size`` < 1.
    """
    if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 0:
        raise ConfigError(f"num_rows must be an int >= 0, got {num_rows!r}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ConfigError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
    out = torch.full((num_rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)
    return out.pin_memory() if pin_memory else out


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Set the logits of disallowed tokens to ``-inf``, in place, on the logits' device.

    Args:
        logits: ``[N, V]`` float (mutated).
        bitmask: int32 ``[M, W]`` with ``W * 32 >= V`` (bit ``t % 32`` of word ``t // 32``
            set = token ``t`` allowed; bits at ``t >= V`` ignored), on the host or any device:
            copied to the logits' device (non-blocking; pin it for an asynchronous copy).
        rows: int64 ``[M]``, bitmask row ``i`` applies to logits row ``rows[i]`` (distinct
            rows; other logits rows untouched); None: ``M == N``, row ``i`` to row ``i``.

    Elementwise per row, so each row's result does not depend on the batch (batch-invariant);
    no host read of any tensor, no Python loop over rows or tokens. O(M * V).

    Raises:
        ConfigError: a bitmask that is not int32 2-D, narrower than ``V`` tokens, or whose row
            count does not match ``N`` (or ``rows``' length).
    """
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or logits.dim() != 2:
        raise ConfigError(f"bitmask must be int32 [M, W] and logits [N, V], got bitmask {bitmask.dtype} "
                          f"{tuple(bitmask.shape)} and logits {tuple(logits.shape)}")
    vocab = logits.shape[1]
    if bitmask.shape[1] * 32 < vocab:
        raise ConfigError(f"bitmask width {bitmask.shape[1]} words covers {bitmask.shape[1] * 32} tokens, "
                          f"fewer than the logits' V = {vocab}")
    expected = logits.shape[0] if rows is None else rows.shape[0]
    if bitmask.shape[0] != expected:
        raise ConfigError(f"bitmask rows must be {expected} (logits rows or len(rows)), got {bitmask.shape[0]}")
    words = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # [M, W, 32]: arithmetic shift, bit 0 kept
    disallowed = (bits == 0).reshape(words.shape[0], -1)[:, :vocab]  # [M, V]
    if rows is None:
        logits.masked_fill_(disallowed, float("-inf"))
        return
    index = rows.to(logits.device, torch.int64, non_blocking=True)
    picked = logits.index_select(0, index)
    picked.masked_fill_(disallowed, float("-inf"))
    logits.index_copy_(0, index, picked)
