"""bare_runner: a runner over the model and its pool with neither drafting nor a balancer —
its sampler and verifier (the injected ones, else the built-ins), static decode buffers and
token slots — warmed up on CUDA (every kernel compiled, the decode graphs captured).
:func:`~deepinfer_kit.engine.runner.build.build_device` profiles and builds the serving
runner over its parts."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import attrs
import torch

from deepinfer_kit._kernels import Impl
from deepinfer_kit.cache.hybrid_kv import KVStorage
from deepinfer_kit.components import BuildContext, Components, build
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.engine.runner.model_runner import ModelRunner
from deepinfer_kit.engine.runner.static_decode import StaticDecode, device_buckets
from deepinfer_kit.engine.runner.token_slots import TokenSlots
from deepinfer_kit.engine.runner.warmup import warm_up
from deepinfer_kit.spec.verify.rejection import RejectionVerifier

if TYPE_CHECKING:
    from deepinfer_kit.models.loader import LoadedModel

__all__ = ["bare_runner"]


def bare_runner(config: EngineConfig, loaded: LoadedModel, kv_cache: KVStorage, max_model_len: int,
                 device: torch.device, parts: Components, ctx: BuildContext, depth: int, *,
                 static: bool) -> ModelRunner:
    """A runner with neither drafting nor a balancer, warmed up (and its decode graphs
    captured) on CUDA. ``static``: decode rounds on static buffers (``build._static_decode``).
    Its sampler and verifier are the injected ones (``parts``), else the built-ins."""
    from deepinfer_kit.sample.vectorized import VectorizedSampler

    on_cuda = device.type == "cuda"
    sampler = build(parts.sampler, ctx)
    if sampler is None:
        sampler = VectorizedSampler(impl=cast(Impl, config.sampler_impl))
    verifier = None
    if config.speculative is not None:
        verifier = build(parts.draft_verifier, attrs.evolve(ctx, sampler=sampler))
        if verifier is None:
            verifier = RejectionVerifier(sampler, cast(Impl, config.sampler_impl),
                                         match_only=config.batch_invariant)
    runner = ModelRunner(
        loaded.model, kv_cache, sampler, device=device,
        generator=torch.Generator(device=device).manual_seed(config.seed),
        static_decode=StaticDecode(
            loaded.model, kv_cache, max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
            context_buckets=device_buckets(kv_cache, config.max_num_seqs, max_model_len),
        ) if static else None,
        verifier=verifier,
        token_slots=TokenSlots((depth + 1) * config.max_num_seqs, device) if depth else None,
    )
    if on_cuda:
        warm_up(runner, max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=max_model_len, capture=config.cuda_graphs and static)
    return runner
