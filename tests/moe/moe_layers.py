"""Seeded random MoE layers for the moe tests, and a guard against host reads."""

from __future__ import annotations

import random
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from deepinfer_kit.moe import MoEConfig, MoELayer


def randomize_moe_layer(layer: MoELayer, seed: int, experts: int, deepseek: bool) -> MoELayer:
    """Fill every parameter with ``randn / sqrt(fan_in)`` from ``seed`` (and the
    DeepSeek-V3 routing bias when ``deepseek``); returns ``layer``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        if deepseek:
            layer.gate.get_buffer("e_score_correction_bias").copy_(torch.randn(experts, generator=gen) * 0.1)
    return layer


HOST_READS = {
    torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.numpy,
    torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__,
    torch.nonzero, torch.Tensor.nonzero, torch.bincount, torch.Tensor.bincount,
    torch.masked_select, torch.Tensor.masked_select, torch.unique, torch.Tensor.unique,
}  # fmt: skip


class _NoHostReads(TorchFunctionMode):
    """Fails on any op that must read device memory on the host (a sync on CUDA), outside
    Triton's own interpreter (which runs kernels on the host by design)."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self._reads_host(func, args, kwargs) and not any(
            "/triton/" in frame.filename for frame in traceback.extract_stack()
        ):
            raise AssertionError(f"host read on the sync-free path: {getattr(func, '__name__', func)}")
        return func(*args, **kwargs)

    @staticmethod
    def _reads_host(func: Callable[..., Any], args: Any, kwargs: Any) -> bool:
        if func in HOST_READS:
            return True
        if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):
            return "output_size" not in kwargs
        if func is torch.Tensor.__getitem__:  # boolean-mask indexing sizes its output on the host
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
        if func is torch.Tensor.to:
            return any(isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu" for a in args[1:])
        return False


@contextmanager
def no_host_reads() -> Iterator[None]:
    with _NoHostReads():
        yield


def make_layer(seed: int, *, shared: bool, impl: str, dtype: torch.dtype = torch.float32,
               device: str = "cpu") -> MoELayer:  # fmt: skip
    rng = random.Random(seed)
    experts = rng.choice([4, 8])
    deepseek = rng.random() < 0.5
    cfg = MoEConfig(
        hidden_size=rng.choice([16, 40]), num_experts=experts, top_k=rng.randint(1, 3),
        intermediate_size=rng.choice([8, 36]), routing="deepseek_v3" if deepseek else "softmax",
        norm_topk_prob=rng.random() < 0.5, n_group=2 if deepseek else 1, topk_group=2 if deepseek else 1,
        routed_scaling_factor=1.5 if deepseek else 1.0, num_shared_experts=int(shared),
        shared_intermediate_size=12 if shared else 0, shared_expert_gate=shared and rng.random() < 0.5,
    )  # fmt: skip
    layer = MoELayer(cfg, impl=impl, dtype=dtype, device=device)  # type: ignore[arg-type]
    return randomize_moe_layer(layer, seed, experts, deepseek)
