"""The executor an engine runs its rounds on when none is given: synchronous, or depth 1
on the device's own mechanism (a CUDA stream, a thread, or a worker process's replies)."""

from __future__ import annotations

import torch

from deepinfer_kit.overlap.protocols import OverlapExecutor

__all__ = ["default_executor"]


def default_executor(overlapped: bool, worker_process: bool, device: str) -> OverlapExecutor | None:
    """When ``overlapped``: a depth-1 executor — with a worker process (``worker_process``),
    one that collects each step's reply when it is waited for; else its kernels on their
    own CUDA stream on a GPU ``device``, a worker thread on CPU. ``None`` (synchronous)
    otherwise. Called once by ``build_engine``."""
    if not overlapped:
        return None
    if worker_process:  # the worker runs it: the host only collects
        from deepinfer_kit.overlap.deferred import DeferredExecutor

        return DeferredExecutor(depth=1)
    if torch.device(device).type == "cuda":
        from deepinfer_kit.overlap.cuda_stream import CudaStreamExecutor

        return CudaStreamExecutor(device, depth=1)
    from deepinfer_kit.overlap.threaded import ThreadExecutor

    return ThreadExecutor(depth=1)
