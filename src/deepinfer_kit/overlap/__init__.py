"""overlap/: synchronous and overlapped (zero-overhead) step execution."""

from deepinfer_kit.overlap.protocols import OverlapExecutor
from deepinfer_kit.overlap.records import PendingStep

__all__ = ["OverlapExecutor", "PendingStep"]
