"""AnalyticCost: a roofline price of a round from a model shape and a GPU spec."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from deepinfer_kit._validators import int_at_least
from deepinfer_kit._validators import positive
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sim.records import StepShape

__all__ = ["ModelShape", "GpuSpec", "AnalyticCost", "QWEN3_1_7B", "TINY", "H200"]


@attrs.frozen(slots=True)
class ModelShape:
    """The dimensions of a dense decoder that decide its cost.

    Attributes:
        hidden_size, num_layers, num_q_heads, num_kv_heads, head_dim,
        intermediate_size, vocab_size: as in a Hugging Face ``config.json``.
        dtype_bytes: bytes per weight and per KV element (2 for bf16).
        max_position_embeddings: the model's longest sequence.
        sliding_window: the window of the sliding-window layers (``None``: none slides).
        sliding_layers: how many of the ``num_layers`` layers slide (Gemma 3's 5 in 6).
            They read (and, with the hybrid KV cache, hold) at most their window of each
            sequence's keys.
    """

    hidden_size: int = attrs.field(validator=int_at_least(1))
    num_layers: int = attrs.field(validator=int_at_least(1))
    num_q_heads: int = attrs.field(validator=int_at_least(1))
    num_kv_heads: int = attrs.field(validator=int_at_least(1))
    head_dim: int = attrs.field(validator=int_at_least(1))
    intermediate_size: int = attrs.field(validator=int_at_least(1))
    vocab_size: int = attrs.field(validator=int_at_least(2))
    dtype_bytes: int = attrs.field(default=2, validator=int_at_least(1))
    max_position_embeddings: int = attrs.field(default=40960, validator=int_at_least(1))
    sliding_window: int | None = attrs.field(default=None, validator=attrs.validators.optional(int_at_least(1)))
    sliding_layers: int = attrs.field(default=0, validator=int_at_least(0))

    def __attrs_post_init__(self) -> None:
        if self.sliding_layers > self.num_layers or (self.sliding_layers > 0) != (self.sliding_window is not None):
            raise ConfigError(
                f"sliding_layers must be in [1, num_layers={self.num_layers}] with a sliding_window, 0 "
                f"without; got sliding_layers={self.sliding_layers}, sliding_window={self.sliding_window}")

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Per layer, the sliding window or ``None`` (the sliding layers first)."""
        return (self.sliding_window,) * self.sliding_layers + (None,) * (self.num_layers - self.sliding_layers)

    @property
    def layer_params(self) -> int:
        """Weights of the decoder layers: attention projections plus a SwiGLU MLP."""
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_q_heads * d * 2 + h * self.num_kv_heads * d * 2
        return self.num_layers * (attn + 3 * h * self.intermediate_size)

    @property
    def num_params(self) -> int:
        """All weights (the embedding counted once: tied, or read only as the LM head)."""
        return self.layer_params + self.vocab_size * self.hidden_size

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes one token occupies over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def sliding_kv_bytes_per_token(self) -> int:
        """K and V bytes one token occupies over the sliding layers."""
        return 2 * self.sliding_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


@attrs.frozen(slots=True)
class GpuSpec:
    """What a GPU can do per second.

    Attributes:
        name: for tables.
        memory_bandwidth: bytes per second of HBM.
        peak_flops: dense FLOP/s at the model's dtype.
        step_overhead_s: fixed host + launch time per round.
        bandwidth_efficiency, flops_efficiency: fractions of the peaks reached (1.0: the
            roofline bound).
        host_bandwidth: bytes per second between device and host memory (the KV tiers'
            copies; 50 GB/s: PCIe Gen5 x16 one way, as measured by vendors' bandwidth
            tests, not the 64 GB/s line rate).
    """

    name: str
    memory_bandwidth: float = attrs.field(validator=positive)
    peak_flops: float = attrs.field(validator=positive)
    step_overhead_s: float = attrs.field(default=0.0)
    bandwidth_efficiency: float = attrs.field(default=1.0, validator=positive)
    flops_efficiency: float = attrs.field(default=1.0, validator=positive)
    host_bandwidth: float = attrs.field(default=50e9, validator=positive)


#: Qwen3-1.7B (tied embeddings).
QWEN3_1_7B = ModelShape(
    hidden_size=2048, num_layers=28, num_q_heads=16, num_kv_heads=8, head_dim=128,
    intermediate_size=6144, vocab_size=151936, dtype_bytes=2, max_position_embeddings=40960,
)

#: The embedded tiny model (``deepinfer_kit.models.tiny``), float32.
TINY = ModelShape(
    hidden_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=128, vocab_size=259, dtype_bytes=4, max_position_embeddings=4096,
)

#: NVIDIA H200 SXM: 4.3 TB/s HBM3e, about 790 TFLOP/s dense bf16; 0.3 ms per round of
#: host work and launches (CUDA graphs on decode).
H200 = GpuSpec("H200", memory_bandwidth=4.3e12, peak_flops=790e12, step_overhead_s=3e-4)


class AnalyticCost:
    """A round costs ``max(bytes / bandwidth, flops / peak) + overhead``.

    Bytes: every weight once, plus the KV the round reads (``num_context_tokens``; the
    sliding layers ``num_window_context_tokens``) and writes (``num_tokens``). FLOPs: ``2 * layer_params`` per token fed, ``2 * H * V``
    per sampled row and per verified draft (the LM head), ``4 * L * q_heads * head_dim`` per attention pair
    (``QK^T`` and ``PV``; a sliding layer's from ``window_attention_pairs``).

    Args:
        model: the model's shape.
        gpu: the GPU's spec.
    """

    __slots__ = ("model", "gpu", "window", "_weights_s", "_kv_s", "_slide_s", "_tok_f", "_row_f", "_pair_f",
                 "_slide_f", "_over", "_xfer_s", "_layers")

    def __init__(self, model: ModelShape, gpu: GpuSpec) -> None:
        self.model = model
        self.gpu = gpu
        bw = gpu.memory_bandwidth * gpu.bandwidth_efficiency
        peak = gpu.peak_flops * gpu.flops_efficiency
        self._weights_s = model.num_params * model.dtype_bytes / bw
        self.window = model.sliding_window
        """The sliding layers' window the shapes must count (``None``: none)."""
        self._slide_s = model.sliding_kv_bytes_per_token / bw
        self._kv_s = model.kv_bytes_per_token / bw - self._slide_s
        self._tok_f = 2.0 * model.layer_params / peak
        self._row_f = 2.0 * model.hidden_size * model.vocab_size / peak
        self._slide_f = 4.0 * model.sliding_layers * model.num_q_heads * model.head_dim / peak
        self._pair_f = 4.0 * model.num_layers * model.num_q_heads * model.head_dim / peak - self._slide_f
        self._over = gpu.step_overhead_s
        self._xfer_s = model.kv_bytes_per_token / gpu.host_bandwidth  # KV tiers' copies: every layer of a block
        self._layers = model.num_layers

    def step_time(self, shape: StepShape) -> float:
        """See :meth:`CostModel.step_time`. Pure; O(1)."""
        spec = shape.num_spec_tokens
        tokens = shape.num_prefill_tokens + shape.num_decode_rows + spec
        memory = self._weights_s + self._kv_s * (shape.num_context_tokens + tokens)
        compute = (
            self._tok_f * tokens
            + self._row_f * (shape.num_sampled_rows + spec)
            + self._pair_f * shape.attention_pairs
        )
        if self.window is not None:
            memory += self._slide_s * (shape.num_window_context_tokens + tokens)
            compute += self._slide_f * shape.window_attention_pairs
        forward = memory if memory > compute else compute
        xfer = self._xfer_s
        layerwise = xfer * shape.num_kv_layerwise_load_tokens  # beside the forward, a layer ahead of it
        hidden = layerwise * (self._layers - 1) / self._layers
        late = hidden - forward if hidden > forward else 0.0
        return (forward + self._over + xfer * (shape.num_kv_transfer_tokens - shape.num_kv_layerwise_load_tokens)
                + layerwise / self._layers + late)

    def decode_round_times(self, num_seqs: int, context: int, start: float, until: float,
                           max_rounds: int) -> list[float]:
        """See :meth:`DecodeRoundCost.decode_round_times`: :meth:`step_time`'s arithmetic,
        in its order, for one plain-decode round after another. Pure; O(rounds).

        Raises:
            ConfigError: the model has sliding layers (a round's window reads depend on each
                sequence's length, not only their sum: price those rounds one by one).
        """
        if self.window is not None:
            raise ConfigError("decode_round_times prices a sum of contexts; sliding layers need each one")
        weights, kv, over = self._weights_s, self._kv_s, self._over
        per_row = self._tok_f * num_seqs + self._row_f * num_seqs  # tokens and LM-head rows
        pair_f = self._pair_f
        times: list[float] = []
        append = times.append
        now = start
        while len(times) < max_rounds and (not times or now < until):
            memory = weights + kv * (context + num_seqs)
            compute = per_row + pair_f * context
            d = (memory if memory > compute else compute) + over
            append(d)
            now += d
            context += num_seqs
        return times


if TYPE_CHECKING:
    from deepinfer_kit.sim.protocols import CostModel, DecodeRoundCost

    _check: type[CostModel] = AnalyticCost
    _rounds: type[DecodeRoundCost] = AnalyticCost
