"""eplb/: expert load windows (per-step counts), replica placement, next-window evaluation, the engine's EplbConfig."""

from deepinfer_kit.eplb.config import POLICY_NAMES, EplbConfig
from deepinfer_kit.eplb.deepseek import GlobalPlacementPolicy, HierarchicalPlacementPolicy, plan_placement
from deepinfer_kit.eplb.evaluate import (
    Evaluation,
    TraceScore,
    balancedness,
    evaluate,
    next_window_score,
    replicas_moved,
    step_balancedness,
)
from deepinfer_kit.eplb.forecast import ForecastPlacementPolicy
from deepinfer_kit.eplb.heatmap import save_heatmaps, text_heatmap
from deepinfer_kit.eplb.movement import MovementAwarePlacementPolicy, align_placement
from deepinfer_kit.eplb.named import make_policy
from deepinfer_kit.eplb.packing import greedy_pack, replicate, round_pack, spread_replicas
from deepinfer_kit.eplb.peak import PeakPlacementPolicy, plan_peak
from deepinfer_kit.eplb.placement_ops import (
    gpu_loads,
    placement_from_phy2log,
    placement_from_ranks,
    validate_topology,
)
from deepinfer_kit.eplb.protocols import PlacementPolicy
from deepinfer_kit.eplb.records import Placement, Topology
from deepinfer_kit.eplb.refine import RefinedPlacementPolicy, plan_refined, refine_swaps
from deepinfer_kit.eplb.window import LoadWindow

__all__ = [
    "EplbConfig", "POLICY_NAMES", "make_policy", "text_heatmap", "save_heatmaps",
    "PlacementPolicy", "Placement", "Topology", "LoadWindow",
    "HierarchicalPlacementPolicy", "GlobalPlacementPolicy", "RefinedPlacementPolicy",
    "ForecastPlacementPolicy", "MovementAwarePlacementPolicy", "PeakPlacementPolicy",
    "plan_placement", "plan_refined", "plan_peak", "refine_swaps", "align_placement",
    "greedy_pack", "round_pack", "replicate", "spread_replicas",
    "validate_topology", "placement_from_ranks", "placement_from_phy2log", "gpu_loads",
    "Evaluation", "TraceScore", "balancedness", "step_balancedness", "evaluate", "next_window_score",
    "replicas_moved",
]
