"""build_engine: the one place that constructs the default components from an EngineConfig."""

from __future__ import annotations

from typing import Any, cast

import attrs
import torch

from deepinfer_kit._dtypes import torch_dtype
from deepinfer_kit._kernels import Impl
from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.engine.assemble import build_tiny_model, load_model
from deepinfer_kit.engine.balance import ExpertBalancer, moe_layers
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.engine.engine import Engine
from deepinfer_kit.engine.host import build_host_components
from deepinfer_kit.engine.runner import ModelRunner
from deepinfer_kit.engine.static_decode import StaticDecode
from deepinfer_kit.engine.token_slots import TokenSlots
from deepinfer_kit.engine.warmup import warm_up
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.embedded import TINY, embedded_checkpoint, is_embedded
from deepinfer_kit.models.loader import LoadedModel
from deepinfer_kit.engine.kv_sizing import kv_budget_bytes, resolve_dtype, size_kv_pool
from deepinfer_kit.models.config import ModelConfig
from deepinfer_kit.models.tokenizer import (
    ByteTokenizer, Tokenizer, load_tokenizer, missing_tokenizer_reason,
)
from deepinfer_kit.overlap.protocols import OverlapExecutor
from deepinfer_kit.sample.protocols import Sampler
from deepinfer_kit.sched.protocols import SchedulerFactory
from deepinfer_kit.engine.drafters import build_drafter
from deepinfer_kit.engine.speculation import Speculation
from deepinfer_kit.engine.sps_profile import forward_timer, measure_sps, sps_points
from deepinfer_kit.spec.ngram import NgramDrafter
from deepinfer_kit.spec.planners import DSparkPlanner, FixedPlanner, ThresholdPlanner
from deepinfer_kit.spec.protocols import Drafter, VerifyPlanner
from deepinfer_kit.spec.records import SpecConfig, SpsCurve
from deepinfer_kit.spec.rejection import RejectionVerifier

__all__ = ["build_engine", "build_speculation"]


def build_engine(
    config: EngineConfig | None = None,
    *,
    make_scheduler: SchedulerFactory | None = None,
    sampler: Sampler | None = None,
    executor: OverlapExecutor | None = None,
    **overrides: Any,
) -> Engine:
    """Load the model and build every default component of ``config`` — the one place
    the engine's concrete parts are assembled.

    ``overrides`` replace config fields (``build_engine(num_blocks=64)``). Any of the
    swappable components can be given instead of the default: a scheduler factory (it
    receives the scheduler config and the KV cache manager), a sampler, an executor.

    Raises:
        ConfigError: bad config values, an unknown device, an unsupported checkpoint, or
            a KV budget too small for ``max_model_len``.
        CheckpointError: a checkpoint folder that cannot be loaded.
    """
    from deepinfer_kit.sample.vectorized import VectorizedSampler

    config = config if config is not None else EngineConfig()
    if overrides:
        try:
            config = attrs.evolve(config, **overrides)
        except TypeError as exc:
            raise ConfigError(f"unknown EngineConfig field in {sorted(overrides)}: {exc}") from exc
    try:
        device = torch.device(config.device)
    except RuntimeError as exc:
        raise ConfigError(f"device must be a torch device string, got {config.device!r}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {config.device!r} asked for, but CUDA is not available")
    dtype = torch_dtype(resolve_dtype(
        config.dtype,
        None if config.model == TINY or config.dtype != "auto"
        else ModelConfig.from_pretrained(
            embedded_checkpoint(config.model) if is_embedded(config.model) else config.model
        ).raw,
    ))
    attention_impl = cast(Impl, config.attention_impl)
    moe_impl = cast(Impl, config.moe_impl)
    if config.model == TINY:
        loaded = build_tiny_model(
            seed=config.seed, dtype=dtype, device=device, attention_impl=attention_impl, moe_impl=moe_impl
        )
    else:
        path = embedded_checkpoint(config.model) if is_embedded(config.model) else config.model
        loaded = load_model(
            path, dtype=dtype, device=device, attention_impl=attention_impl, moe_impl=moe_impl
        )
    mc = loaded.config
    if config.max_model_len is not None and config.max_model_len > mc.max_position_embeddings:
        raise ConfigError(
            f"max_model_len must be <= the model's max_position_embeddings "
            f"({mc.max_position_embeddings}), got {config.max_model_len}"
        )
    budget, source = (None, "") if config.num_blocks is not None else kv_budget_bytes(
        device, kv_cache_memory_mb=config.kv_cache_memory_mb,
        gpu_memory_utilization=config.gpu_memory_utilization,
    )
    num_blocks, max_model_len = size_kv_pool(
        model=mc, block_size=config.block_size, dtype=dtype, budget_bytes=budget,
        budget_source=source, num_blocks=config.num_blocks, max_model_len=config.max_model_len,
    )
    kv_cache = PagedKVCache(
        mc.num_layers, num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim,
        dtype=dtype, device=device, impl=attention_impl,
    )
    scheduler, cache = build_host_components(
        config, num_blocks=num_blocks, max_model_len=max_model_len, make_scheduler=make_scheduler
    )
    generator = torch.Generator(device=device).manual_seed(config.seed)
    on_cuda = device.type == "cuda"
    balancer = (ExpertBalancer(config.eplb, moe_layers(loaded.model), device)
                if config.eplb is not None else None)
    static = balancer is None and (config.static_decode if config.static_decode is not None else (
        on_cuda and config.cuda_graphs))
    sampler = sampler if sampler is not None else VectorizedSampler(impl=cast(Impl, config.sampler_impl))
    drafter = None if config.speculative is None else build_drafter(
        config.speculative, loaded, seed=config.seed, block_size=config.block_size,
        num_blocks=num_blocks, max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
        dtype=dtype, device=device, attention_impl=attention_impl, moe_impl=moe_impl,
    )
    spec = config.speculative
    verifier = None if spec is None else RejectionVerifier(sampler, cast(Impl, config.sampler_impl))
    executor = executor if executor is not None else _default_executor(config)
    depth = executor.depth if executor is not None else 0
    runner = ModelRunner(
        loaded.model,
        kv_cache,
        sampler,
        device=device,
        generator=generator,
        static_decode=StaticDecode(loaded.model, kv_cache, max_num_seqs=config.max_num_seqs,
                                   max_model_len=max_model_len) if static else None,
        verifier=verifier,
        token_slots=TokenSlots((depth + 1) * config.max_num_seqs, device) if depth else None,
    )
    if on_cuda:
        warm_up(runner, max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=max_model_len, capture=config.cuda_graphs and static)
    sps = spec.sps if spec is not None else None
    if spec is not None and sps == "profile" and spec.planner == "dspark":
        chunk = spec.num_draft + 1
        sps = measure_sps(
            forward_timer(runner, chunk, context=max(0, min(64, max_model_len - chunk))),
            sps_points(min(config.max_num_batched_tokens, config.max_num_seqs * chunk)),
        )
    speculation = build_speculation(spec, drafter, sps=sps if isinstance(sps, SpsCurve) else None)
    runner.balancer = balancer  # after warm-up: its dummy rounds stay out of the window
    eos = mc.eos_token_ids
    tokenizer: Tokenizer | None = loaded.tokenizer
    if config.tokenizer is not None:
        tokenizer = load_tokenizer(config.tokenizer, eos_token_id=eos[0] if eos else None,
                                   bos_token_id=mc.bos_token_id, required=True)
    if isinstance(tokenizer, ByteTokenizer) and tokenizer.vocab_size != mc.vocab_size:
        # A checkpoint without tokenizer.json whose vocabulary is not bytes: the byte
        # fallback cannot decode its ids, so the engine takes token ids only.
        tokenizer = None
    return Engine(
        runner=runner,
        scheduler=scheduler,
        cache=cache,
        tokenizer=tokenizer,
        vocab_size=mc.vocab_size,
        eos_token_id=eos[0] if eos else None,
        extra_eos_token_ids=eos[1:],
        executor=executor,
        max_logprobs=config.max_logprobs,
        max_model_len=max_model_len,
        tokenizer_note=missing_tokenizer_reason(mc.folder) if tokenizer is None else None,
        speculation=speculation,
        balancer=balancer,
    )


def build_speculation(
    spec: SpecConfig | None, drafter: Drafter | None = None, *, sps: SpsCurve | None = None,
) -> Speculation | None:
    """The drafting phase of ``spec`` (``None`` without it): ``drafter`` (default: the
    n-gram drafter of ``spec``; ``engine.drafters.build_drafter`` builds the model
    drafters) and the named planner; the DSpark planner's curve is ``sps`` (``build_engine``
    passes ``spec.sps``, or the curve it profiled for ``sps="profile"``), flat when
    ``None``. The verifier is built beside it (a :class:`RejectionVerifier`), since the
    runner needs it before the curve can be profiled."""
    if spec is None:
        return None
    planner: VerifyPlanner
    if spec.planner == "threshold":
        planner = ThresholdPlanner(spec.threshold)
    elif spec.planner == "dspark":
        planner = DSparkPlanner(sps if sps is not None else SpsCurve((1,), (1.0,)))
    else:
        planner = FixedPlanner(spec.num_draft)
    if drafter is None:
        drafter = NgramDrafter(spec.ngram_min, spec.ngram_max)
    return Speculation(drafter, planner, spec.num_draft)


def _default_executor(config: EngineConfig) -> OverlapExecutor | None:
    """When ``config.overlapped``: a depth-1 executor, its kernels on their own CUDA stream
    on a GPU, a worker thread on CPU; else ``None`` (synchronous)."""
    if not config.overlapped:
        return None
    if torch.device(config.device).type == "cuda":
        from deepinfer_kit.overlap.cuda_stream import CudaStreamExecutor

        return CudaStreamExecutor(config.device, depth=1)
    from deepinfer_kit.overlap.threaded import ThreadExecutor

    return ThreadExecutor(depth=1)
