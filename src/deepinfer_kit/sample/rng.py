"""Counter-based random stream of the sampler: one uniform per row, keyed by (seed, position).

A seeded row's uniform is a pure function of its seed and the output position it draws,
so it does not depend on which rows share the batch, on the batch order, or on any
generator state. Unseeded rows take their uniforms from the engine's ``torch.Generator``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer_kit._staging import to_device

__all__ = ["mix64", "seeded_uniform", "row_uniforms"]

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment (2**64 / golden ratio)
_STREAM = 0x5DEECE66D2B7E151  # separates this stream from other users of the same seed
_TWO_POW_MINUS_53 = 2.0**-53


def mix64(z: int) -> int:
    """The splitmix64 finalizer: a bijection on 64-bit integers with full avalanche.

    Args:
        z: any Python int; only its low 64 bits are used.

    Returns:
        An int in ``[0, 2**64)``.
    """
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """The uniform in ``[0, 1)`` that row ``(seed, position)`` draws with.

    ``mix64(mix64(seed + γ) ^ (position + stream))``: for a fixed seed, distinct positions
    give distinct 64-bit words (``mix64`` is a bijection), and for a fixed position
    distinct seeds do too. The top 53 bits become a double, so every value is a multiple
    of ``2**-53`` and strictly below 1.

    Args:
        seed: the request's seed, in ``[0, 2**63)``.
        position: the output index being drawn (0 for the first token), ``>= 0``.
    """
    key = mix64(seed + _GAMMA) ^ ((position + _STREAM) & _MASK64)
    return (mix64(key) >> 11) * _TWO_POW_MINUS_53


def row_uniforms(
    seeds: Sequence[int | None],
    positions: Sequence[int],
    generator: torch.Generator | None,
    device: torch.device,
) -> torch.Tensor:
    """One uniform per row: from ``(seed, position)`` when seeded, else from ``generator``.

    Unseeded rows consume ``count(None in seeds)`` doubles from ``generator`` (torch's
    default generator of ``device`` when ``None``), in row order; seeded rows consume
    nothing.

    Args:
        seeds: ``[n]`` the rows' seeds, ``None`` for unseeded rows.
        positions: ``[n]`` the rows' output positions.
        generator: random source of unseeded rows, on ``device``.
        device: where the result lives.

    Returns:
        ``[n]`` float64 on ``device``, each in ``[0, 1)``.
    """
    values = [0.0 if s is None else seeded_uniform(s, p) for s, p in zip(seeds, positions)]
    out = to_device(values, torch.float64, device)
    unseeded = [i for i, s in enumerate(seeds) if s is None]
    if unseeded:
        drawn = torch.rand(len(unseeded), dtype=torch.float64, device=device, generator=generator)
        out[to_device(unseeded, torch.int64, device)] = drawn
    return out
