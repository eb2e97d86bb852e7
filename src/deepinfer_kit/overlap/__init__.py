"""overlap/: synchronous and overlapped (zero-overhead) step execution."""

from deepinfer_kit.overlap.cuda_stream import CudaStreamExecutor
from deepinfer_kit.overlap.deferred import DeferredExecutor
from deepinfer_kit.overlap.protocols import OverlapExecutor
from deepinfer_kit.overlap.records import PendingStep, TwoPhaseRun
from deepinfer_kit.overlap.sync import SyncExecutor
from deepinfer_kit.overlap.threaded import ThreadExecutor

__all__ = ["CudaStreamExecutor", "DeferredExecutor", "OverlapExecutor", "PendingStep", "SyncExecutor", "ThreadExecutor", "TwoPhaseRun"]
