"""The speculation of an engine on its device: the drafter of ``config.speculative`` beside
the target model, the DSpark planner's curve profiled on the runner, the planner and γ
(:class:`~deepinfer_kit.spec.speculation.Speculation`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from deepinfer_kit._kernels import Impl
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.engine.runner.drafters import build_drafter
from deepinfer_kit.engine.runner.sps_profile import forward_timer, measure_sps, sps_points
from deepinfer_kit.spec.records import SpsCurve
from deepinfer_kit.spec.speculation import Speculation, build_speculation

if TYPE_CHECKING:
    from deepinfer_kit.engine.runner.model_runner import ModelRunner
    from deepinfer_kit.spec.protocols import Drafter, VerifyPlanner
    from deepinfer_kit.models.loader import LoadedModel

__all__ = ["device_speculation"]


def device_speculation(config: EngineConfig, loaded: LoadedModel, runner: ModelRunner, num_blocks: int,
                       max_model_len: int, dtype: torch.dtype, device: torch.device, *,
                       drafter: Drafter | None = None, planner: VerifyPlanner | None = None) -> Speculation | None:
    """The drafting phase of ``config.speculative`` beside ``runner``'s model: its drafter
    (``drafter``, else the named one: a draft model or the target's first layers get KV
    pools of their own on the model's device) and its planner (``planner``, else the named
    one); the DSpark planner's curve is profiled on ``runner`` unless one is given (``sps``
    ``None`` or ``"profile"``), over every round size the budget allows, as the DSpark
    paper's engine does at start-up. ``None`` without speculation. Runs forwards on
    ``runner`` (profiling) but keeps no state in it."""
    spec = config.speculative
    if spec is None:
        return None
    if drafter is None:
        drafter = _named_drafter(config, loaded, runner, num_blocks, max_model_len, dtype, device)
    sps = spec.sps
    if planner is None and spec.planner == "dspark" and not isinstance(sps, SpsCurve):
        chunk = spec.num_draft + 1  # a verify round plus the prefill planned beside it
        sps = measure_sps(
            forward_timer(runner, chunk, context=max(0, min(64, max_model_len - chunk))),
            sps_points(config.max_num_batched_tokens),
        )
    return build_speculation(spec, drafter, sps=sps if isinstance(sps, SpsCurve) else None, planner=planner)


def _named_drafter(config: EngineConfig, loaded: LoadedModel, runner: ModelRunner, num_blocks: int,
                   max_model_len: int, dtype: torch.dtype, device: torch.device) -> Drafter:
    """The drafter ``config.speculative.drafter`` names, beside ``runner``'s model."""
    spec = config.speculative
    assert spec is not None
    return build_drafter(
        spec, loaded, seed=config.seed, block_size=config.block_size,
        num_blocks=num_blocks, max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
        dtype=dtype, device=device, attention_impl=cast(Impl, config.attention_impl),
        moe_impl=cast(Impl, config.moe_impl), kv_heads=runner.kv_cache.num_kv_heads,
    )
