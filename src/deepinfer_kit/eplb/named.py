"""make_policy: the PlacementPolicy an EplbConfig names."""

from __future__ import annotations

from deepinfer_kit.eplb.config import EplbConfig
from deepinfer_kit.eplb.deepseek import GlobalPlacementPolicy, HierarchicalPlacementPolicy
from deepinfer_kit.eplb.forecast import ForecastPlacementPolicy
from deepinfer_kit.eplb.movement import MovementAwarePlacementPolicy
from deepinfer_kit.eplb.peak import PeakPlacementPolicy
from deepinfer_kit.eplb.protocols import PlacementPolicy
from deepinfer_kit.eplb.refine import RefinedPlacementPolicy

__all__ = ["make_policy"]


def make_policy(config: EplbConfig, expert_bytes: int) -> PlacementPolicy:
    """The :class:`PlacementPolicy` ``config.policy`` names (a fresh, stateful one for
    ``"forecast"`` and ``"movement"``); ``expert_bytes`` is one expert's weight size,
    which ``"movement"`` reports as the bytes each rebalance copies. ``"peak"`` plans for
    ``config.dispatch`` (balanced, or an even split for ``"even"`` and ``"static"``)."""
    if config.policy == "deepseek":
        return HierarchicalPlacementPolicy()
    if config.policy == "global":
        return GlobalPlacementPolicy()
    if config.policy == "peak":
        return PeakPlacementPolicy("hierarchical", dispatch="balanced" if config.dispatch == "balanced" else "even")
    refine = RefinedPlacementPolicy("hierarchical")
    if config.policy == "forecast":
        return ForecastPlacementPolicy(refine, decay=config.decay)
    if config.policy == "movement":
        return MovementAwarePlacementPolicy(refine, expert_bytes)
    return refine
