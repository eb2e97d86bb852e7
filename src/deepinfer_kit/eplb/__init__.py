"""eplb/: expert load windows, replica placement, next-window evaluation, the engine's EplbConfig.

Names are resolved on first use (PEP 562), so ``EplbConfig`` imports without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deepinfer_kit.eplb.deepseek import GlobalPlacementPolicy, HierarchicalPlacementPolicy, plan_placement
    from deepinfer_kit.eplb.evaluate import Evaluation, TraceScore, balancedness, evaluate, next_window_score, replicas_moved
    from deepinfer_kit.eplb.forecast import ForecastPlacementPolicy
    from deepinfer_kit.eplb.movement import MovementAwarePlacementPolicy, align_placement
    from deepinfer_kit.eplb.packing import greedy_pack, replicate, round_pack, spread_replicas
    from deepinfer_kit.eplb.placement_ops import gpu_loads, placement_from_phy2log, placement_from_ranks, validate_topology
    from deepinfer_kit.eplb.protocols import PlacementPolicy
    from deepinfer_kit.eplb.records import Placement, Topology
    from deepinfer_kit.eplb.refine import RefinedPlacementPolicy, plan_refined, refine_swaps
    from deepinfer_kit.eplb.window import LoadWindow
    from deepinfer_kit.eplb.config import EplbConfig, POLICY_NAMES
    from deepinfer_kit.eplb.named import make_policy
    from deepinfer_kit.eplb.heatmap import save_heatmaps, text_heatmap

_LAZY = {
    "GlobalPlacementPolicy": "deepinfer_kit.eplb.deepseek",
    "HierarchicalPlacementPolicy": "deepinfer_kit.eplb.deepseek",
    "plan_placement": "deepinfer_kit.eplb.deepseek",
    "Evaluation": "deepinfer_kit.eplb.evaluate",
    "TraceScore": "deepinfer_kit.eplb.evaluate",
    "balancedness": "deepinfer_kit.eplb.evaluate",
    "evaluate": "deepinfer_kit.eplb.evaluate",
    "next_window_score": "deepinfer_kit.eplb.evaluate",
    "replicas_moved": "deepinfer_kit.eplb.evaluate",
    "ForecastPlacementPolicy": "deepinfer_kit.eplb.forecast",
    "MovementAwarePlacementPolicy": "deepinfer_kit.eplb.movement",
    "align_placement": "deepinfer_kit.eplb.movement",
    "greedy_pack": "deepinfer_kit.eplb.packing",
    "replicate": "deepinfer_kit.eplb.packing",
    "round_pack": "deepinfer_kit.eplb.packing",
    "spread_replicas": "deepinfer_kit.eplb.packing",
    "gpu_loads": "deepinfer_kit.eplb.placement_ops",
    "placement_from_phy2log": "deepinfer_kit.eplb.placement_ops",
    "placement_from_ranks": "deepinfer_kit.eplb.placement_ops",
    "validate_topology": "deepinfer_kit.eplb.placement_ops",
    "PlacementPolicy": "deepinfer_kit.eplb.protocols",
    "Placement": "deepinfer_kit.eplb.records",
    "Topology": "deepinfer_kit.eplb.records",
    "RefinedPlacementPolicy": "deepinfer_kit.eplb.refine",
    "plan_refined": "deepinfer_kit.eplb.refine",
    "refine_swaps": "deepinfer_kit.eplb.refine",
    "LoadWindow": "deepinfer_kit.eplb.window",
    "EplbConfig": "deepinfer_kit.eplb.config",
    "POLICY_NAMES": "deepinfer_kit.eplb.config",
    "make_policy": "deepinfer_kit.eplb.named",
    "text_heatmap": "deepinfer_kit.eplb.heatmap",
    "save_heatmaps": "deepinfer_kit.eplb.heatmap",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'deepinfer_kit.eplb' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
