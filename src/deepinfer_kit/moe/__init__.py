"""moe/: gating, dispatch, grouped expert compute, combine, expert parallelism."""

from deepinfer_kit.moe.config import MoEConfig
from deepinfer_kit.moe.experts import GroupedExperts, SharedExpert
from deepinfer_kit.moe.layer import MoELayer, make_router
from deepinfer_kit.moe.local_dispatcher import LocalDispatcher
from deepinfer_kit.moe.protocols import Dispatcher, ReplicaSelector, Router
from deepinfer_kit.moe.replica_layout import ReplicaLayout, Selection
from deepinfer_kit.moe.records import Dispatched, Routing
from deepinfer_kit.moe.routers import DeepSeekV3Router, SoftmaxTopKRouter
from deepinfer_kit.moe.selectors import BalancedSelector, EvenSelector, StaticSelector, make_selector

__all__ = [
    "Router",
    "Dispatcher",
    "Routing",
    "Dispatched",
    "MoEConfig",
    "MoELayer",
    "make_router",
    "SoftmaxTopKRouter",
    "DeepSeekV3Router",
    "LocalDispatcher",
    "GroupedExperts",
    "SharedExpert",
    "ReplicaSelector",
    "ReplicaLayout",
    "Selection",
    "StaticSelector",
    "EvenSelector",
    "BalancedSelector",
    "make_selector",
]
