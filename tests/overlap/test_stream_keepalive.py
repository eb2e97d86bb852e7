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


class _GatedEvent:
    """A real CUDA event whose ``query`` also waits for the test to open a gate: the stream
    "passes" the step only when the test says so, whatever the GPU's speed."""

    def __init__(self, gate: list[bool]) -> None:
        self.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self.gate = gate

    def record(self, stream: Any) -> None:
        self.event.record(stream)

    def query(self) -> bool:
        return self.gate[0] and bool(self.event.query())


@pytest.mark.cuda
def test_a_failed_step_keeps_its_inputs_until_the_stream_passes_them() -> None:
    """The executor's own keep-alive, its events gated: after a step that queued kernels and
    raised, its inputs stay alive (across a later launch's release) until the gate opens;
    then the next launch or ``close`` drops them."""
    from deepinfer_kit.overlap.cuda_stream import CudaStreamExecutor
    from deepinfer_kit.step import StepResult

    executor = CudaStreamExecutor("cuda", depth=1)
    gate = [False]
    executor.alive = StreamKeepAlive(lambda: _GatedEvent(gate))
    inputs = torch.ones(1 << 20, device="cuda")
    ref = weakref.ref(inputs)

    def step(buf: torch.Tensor = inputs) -> StepResult:
        buf.mul_(2)
        raise RuntimeError("failed after queuing kernels")

    pending = executor.launch(0, step)
    del inputs, step
    with pytest.raises(RuntimeError, match="after queuing"):
        executor.wait(pending)
    del pending
    gc.collect()
    assert ref() is not None and len(executor.alive) == 1  # held: the stream has not "passed" it
    executor.wait(executor.launch(1, lambda: StepResult(token_ids=[])))  # its launch releases what passed
    gc.collect()
    assert ref() is not None  # still gated
    gate[0] = True
    executor.stream.synchronize()
    executor.wait(executor.launch(2, lambda: StepResult(token_ids=[])))
    gc.collect()
    assert ref() is None  # passed and released
    executor.close()
    assert len(executor.alive) == 0
