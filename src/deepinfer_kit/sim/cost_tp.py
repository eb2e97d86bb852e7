"""TensorParallelCost: the analytic price of a round on one tensor-parallel instance of
several GPUs, and LLAMA3_70B, a 70B-class dense shape to price."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from deepinfer_kit._validators import int_at_least, positive
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sim.cost_analytic import AnalyticCost, GpuSpec, ModelShape
from deepinfer_kit.sim.records import StepShape

__all__ = ["TensorParallel", "TensorParallelCost", "LLAMA3_70B"]


#: Llama-3.1-70B (meta-llama/Llama-3.1-70B ``config.json``): 80 layers, hidden 8192,
#: 64 query heads, 8 KV heads of 128, SwiGLU 28672, vocabulary 128256, bf16. Its weights
#: read per round count the embedding once (``ModelShape.num_params`` = 69.5 B; the
#: checkpoint holds 70.6 B with the untied input embedding, which a round only gathers);
#: KV 320 KiB per token.
LLAMA3_70B = ModelShape(
    hidden_size=8192, num_layers=80, num_q_heads=64, num_kv_heads=8, head_dim=128,
    intermediate_size=28672, vocab_size=128256, dtype_bytes=2, max_position_embeddings=131072,
)


def _non_negative(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value >= 0:
        raise ConfigError(f"{attribute.name} must be >= 0, got {value!r}")


@attrs.frozen(slots=True)
class TensorParallel:
    """How one instance splits a model over ``size`` GPUs (Megatron-style tensor
    parallelism: attention heads, KV heads, MLP columns and the vocabulary sharded).

    Attributes:
        size: GPUs of the instance (1: no parallelism, no communication).
        bus_bandwidth: bytes/s an all-reduce reaches, as NCCL's "bus bandwidth" (an
            all-reduce of ``B`` bytes over ``size`` GPUs moves ``2 (size - 1) / size * B``
            per GPU); default 360 GB/s, NVLink 4 within a node.
        allreduce_latency_s: fixed time of one all-reduce (launch and synchronisation);
            default 8 us.

    Raises:
        ConfigError: ``size`` < 1, ``bus_bandwidth`` <= 0 or a negative latency.
    """

    size: int = attrs.field(default=1, validator=int_at_least(1))
    bus_bandwidth: float = attrs.field(default=360e9, validator=positive)
    allreduce_latency_s: float = attrs.field(default=8e-6, validator=_non_negative)


class TensorParallelCost:
    """A round on a ``tp.size``-GPU tensor-parallel instance costs
    ``AnalyticCost(model, gpu x size)`` plus its all-reduces (the KV tiers' host copies too
    run ``size`` links wide: each GPU moves its own heads' shard).

    Sharding divides the bytes each GPU reads (weights, KV) and the FLOPs it does by
    ``size``, so the roofline part is :class:`AnalyticCost` on a GPU with ``size`` times
    the bandwidth and peak (the per-round overhead is not divided: each GPU launches
    the whole round). Each layer all-reduces its activations twice (after attention and
    after the MLP), ``tokens * hidden * dtype_bytes`` bytes each, and each all-reduce
    costs ``allreduce_latency_s + 2 (size - 1) / size * bytes / bus_bandwidth``; nothing
    overlaps the communication with compute. ``size`` 1 is exactly :class:`AnalyticCost`.

    Args:
        model: the model's shape (all of it: the instance holds one whole copy).
        gpu: one GPU's spec.
        tp: the instance's parallelism.
    """

    __slots__ = ("model", "gpu", "tp", "window", "_inner", "_per_token", "_fixed")

    def __init__(self, model: ModelShape, gpu: GpuSpec, tp: TensorParallel) -> None:
        self.model = model
        self.gpu = gpu
        self.tp = tp
        n = tp.size
        self._inner = AnalyticCost(model, attrs.evolve(
            gpu, memory_bandwidth=gpu.memory_bandwidth * n, peak_flops=gpu.peak_flops * n,
            host_bandwidth=gpu.host_bandwidth * n))  # each GPU copies its KV shard over its own link
        self.window = self._inner.window
        """The sliding layers' window the shapes must count (``None``: none)."""
        reduces = 2 * model.num_layers if n > 1 else 0
        self._fixed = reduces * tp.allreduce_latency_s
        self._per_token = reduces * 2.0 * (n - 1) / n * model.hidden_size * model.dtype_bytes / tp.bus_bandwidth

    def comm_time(self, num_tokens: int) -> float:
        """Seconds of all-reduces in a round feeding ``num_tokens`` tokens (0 at size 1).
        Pure; O(1)."""
        return self._fixed + self._per_token * num_tokens if self._fixed else 0.0

    def step_time(self, shape: StepShape) -> float:
        """See :meth:`CostModel.step_time`. Pure; O(1)."""
        tokens = shape.num_prefill_tokens + shape.num_decode_rows + shape.num_spec_tokens
        return self._inner.step_time(shape) + self.comm_time(tokens)

    def decode_round_times(self, num_seqs: int, context: int, start: float, until: float,
                           max_rounds: int) -> list[float]:
        """See :meth:`DecodeRoundCost.decode_round_times`: each round is the inner
        model's round plus :meth:`comm_time` of ``num_seqs`` tokens, the very float
        :meth:`step_time` gives. Pure; O(rounds).

        Raises:
            ConfigError: as :meth:`AnalyticCost.decode_round_times` (sliding layers).
        """
        comm = self.comm_time(num_seqs)
        # The inner rounds, without communication, start no later than these: asking it
        # up to the same ``until`` yields every round that starts before it here.
        inner = self._inner.decode_round_times(num_seqs, context, start, until, max_rounds)
        times: list[float] = []
        now = start
        for d in inner:
            if times and now >= until:
                break
            d = d + comm
            times.append(d)
            now += d
        return times


if TYPE_CHECKING:
    from deepinfer_kit.sim.protocols import CostModel, DecodeRoundCost

    _check: type[CostModel] = TensorParallelCost
    _rounds: type[DecodeRoundCost] = TensorParallelCost
