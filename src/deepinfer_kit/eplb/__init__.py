"""eplb/: expert load windows, replica placement, next-window evaluation."""

from deepinfer_kit.eplb.protocols import PlacementPolicy
from deepinfer_kit.eplb.records import Placement, Topology

__all__ = ["PlacementPolicy", "Placement", "Topology"]
