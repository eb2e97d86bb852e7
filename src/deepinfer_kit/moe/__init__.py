"""moe/: gating, dispatch, grouped expert compute, combine, expert parallelism."""

from deepinfer_kit.moe.protocols import Dispatcher, Router
from deepinfer_kit.moe.records import Dispatched, Routing

__all__ = ["Router", "Dispatcher", "Routing", "Dispatched"]
