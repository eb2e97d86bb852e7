"""sample(): the tensor-level entry point of the sampler, for engines that keep sampling
parameters as per-row tensors rather than SamplingParams objects."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from deepinfer_kit._kernels import Impl
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sample.protocols import Sampler
from deepinfer_kit.sample.records import SamplingBatch

__all__ = ["sample"]

PerRow = float | int | torch.Tensor | Sequence[float] | Sequence[int]
"""A scalar (the same for every row) or ``[B]`` values, one per row."""


def _per_row(name: str, value: object, rows: int) -> list[Any]:
    """``rows`` Python values from a scalar, a ``[B]`` tensor or a sequence of ``B``."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return [value.item()] * rows
        if value.shape != (rows,):
            raise ConfigError(f"{name} must be a scalar or of shape [{rows}], got shape {tuple(value.shape)}")
        return list(value.tolist())
    if value is None or isinstance(value, (int, float)):
        return [value] * rows
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) != rows:
            raise ConfigError(f"{name} must be a scalar or hold {rows} values, got {len(value)}")
        return list(value)
    raise ConfigError(f"{name} must be a number, a sequence or a tensor, got {value!r}")


def sample(
    logits: torch.Tensor,
    *,
    temperature: PerRow = 1.0,
    top_k: PerRow = 0,
    top_p: PerRow = 1.0,
    min_p: PerRow = 0.0,
    seeds: int | torch.Tensor | Sequence[int | None] | None = None,
    positions: int | torch.Tensor | Sequence[int] = 0,
    generator: torch.Generator | None = None,
    sampler: Sampler | None = None,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Draw one token per row of ``logits`` with per-row temperature, top-k, top-p, min-p.

    Called by an engine once per step on the rows that sample; reads ``logits`` (never
    mutates them). Each parameter is a scalar (broadcast to every row), a ``[B]`` tensor
    (any device; read to the host once) or a sequence of ``B`` values, with the meaning
    and range of the :class:`SamplingParams` field of that name (temperature 0 is greedy;
    top_k 0 or -1, top_p 1 and min_p 0 are off). A row with a seed draws from a stream
    keyed by ``(seed, position)``: the same seed, position and logits give the same token
    whatever else is in the batch; pass the index of the output token being drawn as
    ``positions`` so successive steps of one sequence differ. Rows without a seed (a
    ``None`` entry) consume ``generator`` (torch's default when ``None``). Penalties and
    logprobs need the history of each row: use a :class:`Sampler` with a
    :class:`SamplingBatch` for those.

    Args:
        logits: ``[B, V]`` float (fp32, fp16 or bf16) on any device.
        temperature, top_k, top_p, min_p: scalars or ``[B]``.
        seeds: ``None`` (no row seeded), an int for every row, or ``[B]`` ints / ``None``s
            in ``[0, 2**63)``.
        positions: output position of each row's draw (scalar or ``[B]``, ``>= 0``).
        generator: random source of unseeded rows, on the logits' device.
        sampler: the sampler to draw with (default: a new
            :class:`~deepinfer_kit.sample.VectorizedSampler` of ``impl``).
        impl: ``"auto"``, ``"ref"`` or ``"triton"`` for that default sampler.

    Returns:
        ``[B]`` int64 token ids on the device of ``logits``.

    Raises:
        ConfigError: ``logits`` not ``[B, V]`` floats with ``V >= 1``, a parameter of the
            wrong shape or type, or a value out of range (the message names the field,
            the row and the value).
        DeviceUnavailableError: ``impl="triton"`` where Triton cannot run.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[1] < 1:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ConfigError(f"logits must be a [B, V] tensor with V >= 1, got {shape}")
    if not logits.is_floating_point():
        raise ConfigError(f"logits must be floating point, got dtype {logits.dtype}")
    rows = logits.shape[0]
    temps = _per_row("temperature", temperature, rows)
    ks = _per_row("top_k", top_k, rows)
    ps = _per_row("top_p", top_p, rows)
    mins = _per_row("min_p", min_p, rows)
    seed_list = _per_row("seeds", seeds, rows)
    pos = _per_row("positions", positions, rows)
    params = []
    for i in range(rows):
        if isinstance(pos[i], bool) or not isinstance(pos[i], int) or pos[i] < 0:
            raise ConfigError(f"positions must be ints >= 0, got {pos[i]!r} (row {i})")
        try:
            params.append(SamplingParams(
                temperature=temps[i], top_k=ks[i], top_p=ps[i], min_p=mins[i], seed=seed_list[i],
            ))  # fmt: skip
        except ConfigError as exc:
            raise ConfigError(f"{exc} (row {i})") from None
    batch = SamplingBatch.build(params, positions=pos, generator=generator)
    if sampler is None:
        from deepinfer_kit.sample.vectorized import VectorizedSampler

        sampler = VectorizedSampler(impl)
    return sampler(logits, batch).token_ids
