"""build_engine: the one place that constructs the default components from an EngineConfig."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import attrs
import torch

from deepinfer_kit._kernels import Impl
from deepinfer_kit.comm.protocols import Communicator
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.engine.runner.drafters import build_drafter, check_speculative
from deepinfer_kit.engine.engine import Engine
from deepinfer_kit.engine.host import build_host_components
from deepinfer_kit.engine.remote.process_group import ProcessGroupRunner
from deepinfer_kit.engine.remote.process_runner import ProcessRunner, WorkerSpec
from deepinfer_kit.engine.remote.rank_groups import build_launched
from deepinfer_kit.engine.remote.balancer import RemoteBalancer
from deepinfer_kit.engine.protocols import Balancer, StepRunner
from deepinfer_kit.engine.runner.model_runner import ModelRunner
from deepinfer_kit.engine.runner.build import RunnerParts, build_runner, engine_device
from deepinfer_kit.engine.runner.drafting import RunnerDrafting
from deepinfer_kit.spec.speculation import Speculation
from deepinfer_kit.engine.runner.sps_profile import forward_timer, measure_sps, sps_points
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.config import ModelConfig
from deepinfer_kit.models.tokenizer import (
    ByteTokenizer, Tokenizer, load_tokenizer, missing_tokenizer_reason,
)
from deepinfer_kit.overlap.protocols import OverlapExecutor
from deepinfer_kit.sample.protocols import Sampler
from deepinfer_kit.sched.protocols import SchedulerFactory
from deepinfer_kit.spec.drafters.ngram import NgramDrafter
from deepinfer_kit.spec.planners import DSparkPlanner, FixedPlanner, ThresholdPlanner
from deepinfer_kit.spec.protocols import Drafter, VerifyPlanner
from deepinfer_kit.spec.records import SpecConfig, SpsCurve

__all__ = ["build_engine", "build_speculation", "load_host_tokenizer", "attach_drafting", "runner_speculation"]


def build_engine(
    config: EngineConfig | None = None,
    *,
    make_scheduler: SchedulerFactory | None = None,
    sampler: Sampler | None = None,
    executor: OverlapExecutor | None = None,
    worker_setup: Callable[[ModelRunner], object] | None = None,
    wrap_comm: Callable[[Communicator], Communicator] | None = None,
    **overrides: Any,
) -> Engine:
    """Load the model and build every default component of ``config`` — the one place
    the engine's concrete parts are assembled.

    ``overrides`` replace config fields (``build_engine(num_blocks=64)``). Any of the
    swappable components can be given instead of the default: a scheduler factory (it
    receives the scheduler config and the KV cache manager), a sampler, an executor.

    With ``worker="process"`` the model, KV pool and sampler are built in a worker process
    (:class:`ProcessRunner`; ``sampler`` must then pickle) and ``worker_setup``, when given,
    is called there with the worker's :class:`ModelRunner` once built (it must pickle by
    reference: instrumentation, fault injection). In the engine's process it is called with
    the runner just the same. With several worker ranks (``tensor_parallel *
    expert_parallel``), ``wrap_comm`` wraps each rank's tensor-parallel communicator
    (fault injection; it must pickle by reference). ``worker="launched"`` builds this
    rank's shard in this process (:func:`build_launched`).

    Raises:
        ConfigError: bad config values, an unknown device, an unsupported checkpoint, or
            a KV budget too small for ``max_model_len``.
        CheckpointError: a checkpoint folder that cannot be loaded.
        EngineDeadError: the worker process exited while building.
    """
    config = config if config is not None else EngineConfig()
    if overrides:
        try:
            config = attrs.evolve(config, **overrides)
        except TypeError as exc:
            raise ConfigError(f"unknown EngineConfig field in {sorted(overrides)}: {exc}") from exc
    check_speculative(config.speculative, config.model, config.max_model_len)  # before any weights
    executor = executor if executor is not None else _default_executor(config)
    depth = executor.depth if executor is not None else 0
    spec = config.speculative
    if config.worker == "process":
        engine_device(config)
        worker = WorkerSpec(config, depth, sampler, worker_setup, torch.get_num_threads(),
                            wrap_comm=wrap_comm)
        remote: ProcessRunner | ProcessGroupRunner = (
            ProcessGroupRunner(worker) if config.expert_parallel * config.tensor_parallel > 1
            else ProcessRunner(worker)
        )  # one worker per rank
        info = remote.info
        remote_balancer = None
        if config.eplb is not None:
            assert info.balancer is not None  # the worker built one
            remote_balancer = RemoteBalancer(remote, config.eplb, info.balancer)
        return _reserve_drafts(_engine(  # with speculation the worker drafts, round by round
            config, remote, info.model, load_host_tokenizer(info.model), info.num_blocks,
            info.max_model_len, executor, make_scheduler, balancer=remote_balancer,
        ), spec, True)
    parts = (build_launched(config, sampler=sampler, depth=depth) if config.worker == "launched"
             else build_runner(config, sampler=sampler, depth=depth))
    runner, loaded, num_blocks, max_model_len = parts.runner, parts.loaded, parts.num_blocks, parts.max_model_len
    speculation = runner_speculation(config, parts)
    if speculation is not None and depth:  # overlapped: the runner drafts, round by round
        attach_drafting(runner, speculation)
        speculation = None
    runner.balancer = parts.balancer  # after warm-up: its dummy rounds stay out of the window
    if worker_setup is not None:
        worker_setup(runner)
    return _reserve_drafts(_engine(
        config, runner, loaded.config, loaded.tokenizer, num_blocks, max_model_len, executor,
        make_scheduler, speculation=speculation, balancer=parts.balancer,
    ), spec, bool(depth))


def runner_speculation(config: EngineConfig, parts: RunnerParts) -> Speculation | None:
    """The drafting phase of ``config.speculative`` beside ``parts``' runner: its drafter
    (a draft model or the target's first layers get KV pools of their own on the model's
    device), the DSpark planner's curve profiled on the runner unless one is given
    (``sps`` ``None`` or ``"profile"``); ``None`` without speculation. Called once per
    engine, in the process that holds the model."""
    spec = config.speculative
    if spec is None:
        return None
    runner, max_model_len = parts.runner, parts.max_model_len
    drafter = build_drafter(
        spec, parts.loaded, seed=config.seed, block_size=config.block_size,
        num_blocks=parts.num_blocks, max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
        dtype=parts.dtype, device=parts.device, attention_impl=cast(Impl, config.attention_impl),
        moe_impl=cast(Impl, config.moe_impl), kv_heads=runner.kv_cache.num_kv_heads,
    )
    sps = spec.sps
    if spec.planner == "dspark" and not isinstance(sps, SpsCurve):
        # profiled once, over every round size the budget allows (a verify round plus
        # the prefill planned beside it), as the DSpark paper's engine does at start-up
        chunk = spec.num_draft + 1
        sps = measure_sps(
            forward_timer(runner, chunk, context=max(0, min(64, max_model_len - chunk))),
            sps_points(config.max_num_batched_tokens),
        )
    return build_speculation(spec, drafter, sps=sps if isinstance(sps, SpsCurve) else None)


def attach_drafting(runner: ModelRunner, speculation: Speculation) -> RunnerDrafting:
    """Overlapped speculation: ``runner`` drafts each round as it executes it
    (:class:`RunnerDrafting` over ``speculation``), hands the draft distributions to its
    verifier, and keeps the drafter's per-sequence state as long as the token slots (a
    runner without them, in a synchronous worker: while the sequence has a chunk in each round)."""
    drafting = RunnerDrafting(speculation, follows_slots=runner.token_slots is not None)
    runner.drafting = drafting
    runner.draft_probs = speculation.draft_probs
    if runner.token_slots is not None:
        runner.token_slots.followers.append(drafting)
    return drafting


def _reserve_drafts(engine: Engine, spec: SpecConfig | None, runner_drafts: bool) -> Engine:
    """Speculation drafted by the runner (overlapped, or in a worker process): the
    scheduler plans room for its drafts."""
    if spec is not None and runner_drafts:
        reserve = getattr(engine.scheduler, "reserve_drafts", None)
        if not callable(reserve):
            engine.close()
            raise ConfigError(
                f"speculation drafted by the runner (overlap, or worker='process') needs a "
                f"scheduler with reserve_drafts(); {type(engine.scheduler).__name__} has none: "
                f"set overlap=False and worker='inline'"
            )
        reserve(spec.num_draft)
    return engine


def _engine(
    config: EngineConfig, runner: StepRunner, mc: ModelConfig, tokenizer: Tokenizer | None,
    num_blocks: int, max_model_len: int, executor: OverlapExecutor | None,
    make_scheduler: SchedulerFactory | None, *, speculation: Speculation | None = None,
    balancer: Balancer | None = None,
) -> Engine:
    """The host half: scheduler, cache manager and tokenizer around ``runner``."""
    scheduler, cache = build_host_components(
        config, num_blocks=num_blocks, max_model_len=max_model_len, make_scheduler=make_scheduler
    )
    eos = mc.eos_token_ids
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


def load_host_tokenizer(mc: ModelConfig) -> Tokenizer:
    """The tokenizer the model's loader would give (the checkpoint folder's, else the
    byte-level one), for a host whose model lives in a worker process."""
    if mc.folder is None:
        return ByteTokenizer()
    eos = mc.eos_token_ids
    return load_tokenizer(mc.folder, eos_token_id=eos[0] if eos else None, bos_token_id=mc.bos_token_id)


def build_speculation(
    spec: SpecConfig | None, drafter: Drafter | None = None, *, sps: SpsCurve | None = None,
) -> Speculation | None:
    """The drafting phase of ``spec`` (``None`` without it): ``drafter`` (default: the
    n-gram drafter of ``spec``; ``engine.drafters.build_drafter`` builds the model
    drafters) and the named planner; the DSpark planner's curve is ``sps`` (``build_engine``
    passes ``spec.sps``, or the curve it profiled). The verifier is built beside it (a
    :class:`RejectionVerifier`), since the runner needs it before the curve can be profiled.

    Raises:
        ConfigError: ``planner="dspark"`` without a curve (neither ``sps`` nor an
            ``SpsCurve`` in ``spec.sps``): the planner has nothing to trade drafts against.
    """
    if spec is None:
        return None
    planner: VerifyPlanner
    if spec.planner == "threshold":
        planner = ThresholdPlanner(spec.threshold, spec.threshold_rule)
    elif spec.planner == "dspark":
        curve = sps if sps is not None else spec.sps
        if not isinstance(curve, SpsCurve):
            raise ConfigError(
                f"speculative.sps: planner='dspark' needs an SpsCurve (the engine profiles "
                f"one when it is built), got {curve!r}"
            )
        planner = DSparkPlanner(curve)
    else:
        planner = FixedPlanner(spec.num_draft)
    if drafter is None:
        drafter = NgramDrafter(spec.ngram_min, spec.ngram_max)
    return Speculation(drafter, planner, spec.num_draft)


def _default_executor(config: EngineConfig) -> OverlapExecutor | None:
    """When ``config.overlapped``: a depth-1 executor — with a worker process, one that
    collects each step's reply when it is waited for; else its kernels on their own CUDA
    stream on a GPU, a worker thread on CPU. ``None`` (synchronous) otherwise."""
    if not config.overlapped:
        return None
    if config.worker == "process":  # the worker runs it: the host only collects
        from deepinfer_kit.overlap.deferred import DeferredExecutor

        return DeferredExecutor(depth=1)
    if torch.device(config.device).type == "cuda":
        from deepinfer_kit.overlap.cuda_stream import CudaStreamExecutor

        return CudaStreamExecutor(config.device, depth=1)
    from deepinfer_kit.overlap.threaded import ThreadExecutor

    return ThreadExecutor(depth=1)
