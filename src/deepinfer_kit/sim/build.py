"""build_simulator: the engine's scheduler and KV cache manager (built by the engine's own
code from an EngineConfig) wired to a cost-model runner and a virtual clock."""

from __future__ import annotations


from deepinfer_kit.components import DEVICE_KINDS, BuildContext, Components, Factory, build
from deepinfer_kit.engine.config import DEFAULT_KV_CACHE_MEMORY_MB, EngineConfig
from deepinfer_kit.engine.host import build_host_components
from deepinfer_kit.sim.tiers import sim_tiers
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sim.clock import VirtualClock
from deepinfer_kit.sim.cost_analytic import ModelShape
from deepinfer_kit.sim.expert_records import ExpertRouting
from deepinfer_kit.sim.prompts import PromptBuilder
from deepinfer_kit.sim.protocols import CostModel
from deepinfer_kit.sim.runner import SimRunner
from deepinfer_kit.sim.simulator import Simulator
from deepinfer_kit.sim.tokens import SyntheticTokens


__all__ = ["build_simulator", "pool_blocks"]


def pool_blocks(config: EngineConfig, model: ModelShape, max_model_len: int) -> int:
    """Blocks in the simulated pool: ``config.num_blocks``, or as many as
    ``kv_cache_memory_mb`` holds at ``model``'s KV bytes per token (the same rule as
    the engine's ``size_kv_pool``, on a shape instead of a loaded model); with sliding
    layers under ``config.hybrid_kv_cache``, the full layers' blocks from what the
    sliding layers' pools leave.

    Raises:
        ConfigError: the pool holds fewer than ``max_model_len`` tokens.
    """
    P = config.block_size
    layout = config.kv_layout(model.windows)
    mb = config.kv_cache_memory_mb
    budget: int | None = (DEFAULT_KV_CACHE_MEMORY_MB if mb is None else mb) << 20
    per_token = model.kv_bytes_per_token
    fixed = config.num_blocks
    if layout is not None:  # the sliding layers' pools first, as the engine sizes them
        layer_token_bytes = model.kv_bytes_per_token // model.num_layers
        fixed, budget = config.full_group_share(layout, budget, layer_token_bytes, max_model_len)
        per_token -= model.sliding_kv_bytes_per_token
    if fixed is not None:
        num_blocks = fixed
    else:
        assert budget is not None
        num_blocks = budget // (per_token * P)
    if num_blocks * P < max_model_len:
        raise ConfigError(
            f"the KV pool holds {num_blocks} blocks of {P} tokens = {num_blocks * P} tokens, "
            f"fewer than max_model_len={max_model_len}; raise num_blocks or "
            f"kv_cache_memory_mb, or lower max_model_len"
        )
    return num_blocks


def build_simulator(
    config: EngineConfig,
    cost: CostModel | Factory[CostModel] | None,
    model: ModelShape,
    *,
    eos_token_id: int | None = None,
    seed: int = 0,
    components: Components | None = None,
    routing: ExpertRouting | None = None,
) -> Simulator:
    """A :class:`Simulator` of ``config``'s scheduler and cache on ``cost``.

    ``config`` fields that concern the device (model, dtype, device, kernels, CUDA
    graphs, overlap) are ignored; the scheduler, cache and pool fields are used exactly
    as ``build_engine`` uses them, and so are ``components``' host kinds (block allocator,
    eviction policy, prefix index, cache manager, scheduler and its policies): each
    factory gets the simulator's virtual clock as ``BuildContext.clock``. With
    ``config.speculative`` the simulator speculates as the engine does (its
    ``RunnerDrafting``, the scheduler's draft room): the drafter (``components.drafter``,
    else the n-gram one) drafts from the synthetic tokens, the planner
    (``components.verify_planner``, else the named one; ``"dspark"`` needs
    ``speculative.sps``) cuts, and drafts are verified against the synthetic target. ``cost`` (or
    ``components.cost_model``: one of the two) prices each round. ``model`` sizes the
    pool (``kv_cache_memory_mb``) and gives the vocabulary and the default
    ``max_model_len``. With ``config.eplb`` set, a simulated MoE router (``routing``,
    default 64 experts, top-8, one MoE layer per ``model`` layer) and the policy it names
    (or ``components.placement_policy``) take part (:class:`ExpertSim`); ``routing``
    alone does nothing. With ``config.kv_tiers`` the real tiers' scheduler side decides what
    goes down and comes back (:func:`sim_tiers`: slots and keys, no bytes; disk reads land at
    once) and the cost model prices each round's device <-> host copies.

    Raises:
        ConfigError: a pool too small for ``max_model_len``, bad config values, no cost
            model or two, or a device component (the simulator runs no model).
    """
    parts = components if components is not None else Components()
    device = [k for k in DEVICE_KINDS if k not in _SIM_KINDS and getattr(parts, k) is not None]
    if device or parts.executor is not None:
        raise ConfigError(f"components.{(device or ['executor'])[0]} runs beside a model: the simulator "
                          f"has none (its cost model prices the rounds)")
    if (cost is None) == (parts.cost_model is None):
        raise ConfigError("build_simulator needs one cost model: the cost argument or "
                          "components.cost_model, got " + ("none" if cost is None else "both"))
    max_model_len = config.max_model_len or model.max_position_embeddings
    num_blocks = pool_blocks(config, model, max_model_len)
    clock = VirtualClock()
    scheduler, cache = build_host_components(
        config, num_blocks=num_blocks, max_model_len=max_model_len, components=parts, clock=clock,
        windows=model.windows, connector=sim_tiers(config, config.block_size),
    )
    ctx = BuildContext(config=config, clock=clock, block_size=config.block_size, num_blocks=num_blocks,
                       max_model_len=max_model_len, cache=cache, vocab_size=model.vocab_size)
    priced = build(cost if cost is not None else parts.cost_model, ctx)
    assert priced is not None
    eos = eos_token_id if eos_token_id is not None else model.vocab_size - 1
    tokens = SyntheticTokens(model.vocab_size, eos, seed)
    experts = None
    if config.eplb is not None:
        from deepinfer_kit.sim.experts import ExpertSim  # torch and eplb, only when asked

        experts = ExpertSim(config.eplb, routing or ExpertRouting(num_layers=model.num_layers),
                            policy=build(parts.placement_policy, ctx))
    elif parts.placement_policy is not None:
        raise ConfigError("components.placement_policy needs eplb={...}, got eplb=None")
    runner = SimRunner(priced, tokens, experts, block_size=config.block_size,
                       layerwise_loads=config.kv_tiers is not None and config.kv_tiers.layerwise_loads)
    sim = Simulator(scheduler, cache, runner, clock, PromptBuilder(model.vocab_size, seed), eos)
    if config.speculative is not None:
        _speculate(sim, config, parts, ctx)
    elif parts.drafter is not None or parts.verify_planner is not None:
        raise ConfigError("components.drafter / verify_planner need speculative={...}, got speculative=None")
    return sim


_SIM_KINDS = ("drafter", "verify_planner", "placement_policy")
"""Device kinds the simulator runs too (on its synthetic tokens and experts)."""


def _speculate(sim: Simulator, config: EngineConfig, parts: Components, ctx: BuildContext) -> None:
    """Speculation in ``sim`` as ``config.speculative`` and ``parts`` give it."""
    from deepinfer_kit.sim.spec_runner import speculate_as_configured

    assert config.speculative is not None
    speculate_as_configured(sim, config.speculative, build(parts.drafter, ctx), build(parts.verify_planner, ctx))
