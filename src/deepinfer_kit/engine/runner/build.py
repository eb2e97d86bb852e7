"""build_device: the device half of an engine — model, KV pool, sampler, runner, drafting
and live EPLB — from an EngineConfig; the one builder the engine's process, a spawned worker
and a launcher-started rank all call.

The order is fixed, and the same in every process:

1. the model (this rank's tensor-parallel shard under ``groups``, with any injected
   routers and dispatchers) and its KV pool, sized from the budget
   (:mod:`~deepinfer_kit.engine.runner.kv_sizing`);
2. a bare runner over them (:func:`~deepinfer_kit.engine.runner.bare.bare_runner`:
   sampler, verifier, static decode, token slots), warmed up on CUDA: every kernel
   compiled and the decode graphs captured;
3. the experts split over the expert-parallel group (after the warm-up's local forwards:
   from here every forward is collective), and the live balancer over them;
4. the speculation of ``config.speculative``: its drafter and planner (injected, or the
   named ones: the DSpark planner's curve profiled on the bare runner unless one is given);

Every component a :class:`~deepinfer_kit.components.Components` gives is built here, in
the process that runs it, from a :class:`~deepinfer_kit.components.BuildContext`.
5. the serving runner: the same parts, with its drafting and balancer given to its
   constructor (warm-up and profiling rounds stay out of the balancer's window and the
   drafter's state), then the ``setup`` hook.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import attrs
import torch

from deepinfer_kit.components import BuildContext, Components, build
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.engine.runner.balance import ExpertBalancer, moe_layers
from deepinfer_kit.engine.runner.bare import bare_runner
from deepinfer_kit.engine.runner.drafting import RunnerDrafting
from deepinfer_kit.engine.runner.expert_shards import shard_experts
from deepinfer_kit.engine.runner.grammar_stage import GrammarStage
from deepinfer_kit.engine.runner.model_runner import ModelRunner
from deepinfer_kit.engine.runner.speculative import ServingRunner, SpeculativeRunner
from deepinfer_kit.engine.runner.pool import check_kernel_impls, engine_device, kv_pool, load_shard, model_dtype
from deepinfer_kit.engine.runner.speculation import device_speculation
from deepinfer_kit.sample.structured.check import tokenizer_backend

if TYPE_CHECKING:
    from deepinfer_kit.comm.world import ParallelGroups
    from deepinfer_kit.models.loader import LoadedModel

__all__ = ["DeviceParts", "build_device"]


@attrs.define(slots=True, eq=False)
class DeviceParts:
    """What :func:`build_device` made.

    Attributes:
        loaded: the model (this rank's shard), its config and tokenizer.
        runner: the serving runner: the plain one, its balancer in place, or with
            speculation the :class:`SpeculativeRunner` around it.
        num_blocks: blocks in the pool (sized from the budget when the config left it open).
        max_model_len: the engine's limit (capped to the pool when the config left it open).
        dtype: weights and KV dtype.
        device: the model's device.
        balancer: live EPLB when ``config.eplb`` (also the runner's).
    """

    loaded: LoadedModel
    runner: ServingRunner
    num_blocks: int
    max_model_len: int
    dtype: torch.dtype
    device: torch.device
    balancer: ExpertBalancer | None



def build_device(config: EngineConfig, *, depth: int, components: Components | None = None,
                 groups: ParallelGroups | None = None,
                 setup: Callable[[ServingRunner], object] | None = None) -> DeviceParts:
    """Build the device half of ``config`` in the order of the module docstring.

    ``depth``: the engine's executor depth (1: token slots for overlapped rounds).
    ``components``: device components of yours (:class:`Components`: sampler, verifier,
    drafter, planner, per-layer routers / dispatchers / replica selectors, placement
    policy), each an instance or a :class:`Factory` called here with a
    :class:`BuildContext`; the rest are the built-ins ``config`` names. ``groups``: this
    rank's tensor- and expert-parallel groups (``None``: a single-rank model). ``setup``:
    called with the serving runner once built (instrumentation, fault injection).

    Called once per engine: by ``build_engine`` in the engine's process (and for a
    ``worker="launched"`` rank), or in a worker process by
    :mod:`deepinfer_kit.engine.remote.worker_main`.

    Raises:
        ConfigError: bad config values, an unknown device, an unsupported checkpoint,
            ``max_model_len`` beyond the model's, a KV budget too small for it, or experts
            that do not divide over the expert-parallel ranks.
        CheckpointError: a checkpoint folder that cannot be loaded.
    """
    parts = components if components is not None else Components()
    device = engine_device(config)
    check_kernel_impls(config, device)
    dtype = model_dtype(config, device)
    ctx = BuildContext(config=config, clock=time.monotonic, block_size=config.block_size, device=str(device))
    loaded = load_shard(config, dtype, device, groups, parts, ctx)
    kv_cache, num_blocks, max_model_len = kv_pool(config, loaded.config, dtype, device, groups)
    ctx = attrs.evolve(ctx, num_blocks=num_blocks, max_model_len=max_model_len, model=loaded.model,
                       vocab_size=loaded.config.vocab_size)
    static = _static_decode(config, device)
    eplb = _eplb_parts(parts, ctx)
    balancer = (ExpertBalancer(config.eplb, moe_layers(loaded.model), device, capturable=static, **eplb)
                if config.eplb is not None and config.expert_parallel == 1 else None)  # EP: after sharding
    bare = bare_runner(config, loaded, kv_cache, max_model_len, device, parts, ctx, depth, static=static)
    if config.expert_parallel > 1:
        balancer = shard_experts(loaded.model, config.expert_parallel, config.eplb, device,
                                 group=groups.ep_group if groups is not None else None, **eplb)
    speculation = device_speculation(config, loaded, bare, num_blocks, max_model_len, dtype, device,
                                     drafter=build(parts.drafter, ctx), planner=build(parts.verify_planner, ctx))
    plain = ModelRunner(
        bare.model, bare.kv_cache, bare.sampler, device=device, generator=bare.generator,
        static_decode=bare.static, verifier=bare.verifier, balancer=balancer,
        token_slots=bare.token_slots,
        draft_probs=speculation.draft_probs if speculation is not None else None,
        grammar=GrammarStage(partial(tokenizer_backend, loaded.tokenizer, loaded.config.vocab_size,
                                     loaded.config.eos_token_ids), pin_memory=device.type == "cuda"),
    )
    runner: ServingRunner = plain
    if speculation is not None:
        runner = SpeculativeRunner(plain, RunnerDrafting(speculation, slots=bare.token_slots))
    if setup is not None:
        setup(runner)
    return DeviceParts(loaded, runner, num_blocks, max_model_len, dtype, device, balancer)


def _eplb_parts(parts: Components, ctx: BuildContext) -> dict[str, Any]:
    """The balancer's injected placement policy and per-layer replica selectors, as
    keyword arguments of :class:`ExpertBalancer` (empty when none is injected)."""
    out: dict[str, Any] = {}
    if parts.placement_policy is not None:
        out["policy"] = build(parts.placement_policy, ctx)
    factory = parts.replica_selector
    if factory is not None:
        out["selectors"] = lambda layer: factory(attrs.evolve(ctx, layer=layer))
    return out


def _static_decode(config: EngineConfig, device: torch.device) -> bool:
    """Whether decode rounds run on static buffers: ``config.static_decode``, or by default
    exactly when graphs are captured (CUDA with ``cuda_graphs``); never under expert
    parallelism, whose dispatch would carry the padded rows across ranks."""
    if config.expert_parallel > 1:
        return False
    if config.static_decode is not None:
        return config.static_decode
    return device.type == "cuda" and config.cuda_graphs
