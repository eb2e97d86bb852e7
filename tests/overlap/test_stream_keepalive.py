"""A step's closure (and the input buffers it holds) outlives the step until the executor's
stream has passed its kernels, whether the step returned or raised: the cross-stream
reuse guard of :class:`CudaStreamExecutor`, checked with fake events on CPU and for real
on a GPU."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch

from deepinfer_kit.overlap.cuda_stream import StreamKeepAlive


class _FakeEvent:
    def __init__(self, done: list[bool]) -> None:
        self.done, self.index = done, -1

    def record(self, stream: Any) -> None:
        self.index = len(self.done)
        self.done.append(False)

    def query(self) -> bool:
        return self.done[self.index]


class _Buffer:
    """Stands in for a step's device input buffer (weak-referenceable)."""


def test_held_objects_live_until_the_stream_passes_them_in_order() -> None:
    done: list[bool] = []
    alive = StreamKeepAlive(lambda: _FakeEvent(done))
    first, second = _Buffer(), _Buffer()
    refs = [weakref.ref(first), weakref.ref(second)]
    alive.hold(first, stream=None)  # type: ignore[arg-type]
    alive.hold(second, stream=None)  # type: ignore[arg-type]
    del first, second
    gc.collect()
    alive.release_passed()
    assert len(alive) == 2 and all(r() is not None for r in refs)  # kernels still queued
    done[1] = True  # never released ahead of an older step
    alive.release_passed()
    assert len(alive) == 2
    done[0] = True
    alive.release_passed()
    gc.collect()
    assert len(alive) == 0 and all(r() is None for r in refs)
    alive.hold(_Buffer(), stream=None)  # type: ignore[arg-type]
    alive.clear()
    assert len(alive) == 0


@pytest.mark.cuda
def test_a_failed_step_keeps_its_inputs_until_the_stream_passes_them() -> None:
    from deepinfer_kit.overlap.cuda_stream import CudaStreamExecutor
    from deepinfer_kit.step import StepResult

    executor = CudaStreamExecutor("cuda", depth=1)
    inputs = torch.ones(1 << 20, device="cuda")
    ref = weakref.ref(inputs)

    def step(buf: torch.Tensor = inputs) -> StepResult:
        torch.cuda._sleep(50_000_000)  # type: ignore[attr-defined]  # keep the stream busy
        buf.mul_(2)
        raise RuntimeError("failed after queuing kernels")

    pending = executor.launch(0, step)
    del inputs, step
    with pytest.raises(RuntimeError, match="after queuing"):
        executor.wait(pending)
    del pending
    gc.collect()
    assert ref() is not None or executor.stream.query()  # held while the stream reads it
    executor.close()
    gc.collect()
    assert ref() is None and len(executor.alive) == 0
