"""Rotary position embeddings: inverse frequencies of each scaling variant, and their application.

The frequencies follow the transformers definitions (default, linear, llama3, yarn) so that
logits match the reference implementation; the rotation is the "rotate half" layout over the
first ``rotary_dim`` dims of each head (partial rotary leaves the rest unchanged).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from deepinfer_kit.models.config_parts import RopeConfig

__all__ = ["inverse_frequencies", "RotaryEmbedding", "apply_rotary"]


def inverse_frequencies(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """``([rotary_dim / 2] float32 inverse frequencies on the CPU, cos/sin scale)``."""
    dim = rope.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope)
    return inv_freq, 1.0


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    dim, base, factor = rope.rotary_dim, rope.theta, rope.factor
    if rope.attention_factor is not None:
        attention_factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        length = rope.original_max_position_embeddings
        return (dim * math.log(length / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Rotates queries and keys by their positions.

    Call :meth:`cos_sin` once per forward (shared by every layer), then :meth:`rotate` on
    each layer's queries and keys.
    """

    inv_freq: torch.Tensor

    def __init__(self, rope: RopeConfig, *, device: str | torch.device = "cpu") -> None:
        super().__init__()
        inv_freq, scale = inverse_frequencies(rope)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.scale = scale
        self.rotary_dim = rope.rotary_dim

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` ``[T]`` int64 -> ``(cos, signed_sin)``, each ``[T, 1, rotary_dim]`` in
        ``dtype``, for :meth:`rotate`.

        Computed in float32 (as the reference does) and cast once. ``signed_sin`` carries the
        sign of the "rotate half" pairing: ``[-sin, sin]`` over the two halves.
        """
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        cos = torch.cat((cos, cos), dim=-1)
        signed_sin = torch.cat((-sin, sin), dim=-1)
        return cos.to(dtype)[:, None, :], signed_sin.to(dtype)[:, None, :]

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, heads, head_dim]`` (returns a new tensor of the same shape).

        Pairs dim ``i`` with ``i + rotary_dim / 2``: ``[x1, x2] -> [x1 c - x2 s, x2 c + x1 s]``.
        """
        return apply_rotary(x, cos, signed_sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """The "rotate half" rotation of the first ``rot = cos.shape[-1]`` dims of each head.

    Called by :meth:`RotaryEmbedding.rotate` and by the fused RoPE + KV-write reference
    (``models.rope_kv``). Pairs dim ``i`` with ``i + rot / 2``:
    ``[x1, x2] -> [x1 c - x2 s, x2 c + x1 s]``; dims past ``rot`` pass unchanged (partial
    rotary). Arithmetic in ``x.dtype``, each product and the sum rounded to it.

    Args:
        x: ``[T, heads, D]``, any device.
        cos, signed_sin: ``[T, 1, rot]`` from :meth:`RotaryEmbedding.cos_sin`, same dtype
            and device as ``x``; ``rot`` even and ``<= D``.

    Returns:
        A new ``[T, heads, D]`` tensor. Mutates nothing.
    """
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + _swap_halves(x) * signed_sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + _swap_halves(x_rot) * signed_sin, x_pass), dim=-1)


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [x2, x1]`` over the last dim (a copy)."""
    halves = x.reshape(*x.shape[:-1], 2, x.shape[-1] // 2)
    return torch.flip(halves, dims=(-2,)).reshape(x.shape)
