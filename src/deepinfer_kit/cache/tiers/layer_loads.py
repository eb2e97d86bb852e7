"""LayerLoads: one round's host-to-device block loads, copied layer by layer beside the
forward, so layer ``i`` of the forward waits only for layer ``i``'s copy (vLLM's
``wait_for_layer_load``) instead of the whole round's."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from deepinfer_kit.cache.hybrid_kv import KVStorage
from deepinfer_kit.cache.tiers.layer_targets import LayerTarget

__all__ = ["LayerLoads"]


class LayerLoads:
    """Copies host slab slots into device blocks one layer at a time, asynchronously to
    the caller, and lets the caller wait for one layer.

    On CUDA the copies run on a stream of their own (after everything the runner's stream
    queued before :meth:`start`: the round's saves and copy-on-write copies), one pinned
    host-to-device copy and one scatter per layer, an event recorded after each;
    :meth:`wait_layer` makes the caller's stream wait for that event (the host does not
    wait). On the CPU one background thread copies layer after layer and sets a flag per
    layer; :meth:`wait_layer` blocks until that layer's flag is set.

    One round's loads at a time: :meth:`start` first finishes the previous round's
    (:meth:`wait_all`). Layers touch disjoint memory, so the forward writing layer ``j``'s
    new tokens while layer ``i > j`` is being loaded is safe; the loaded blocks are whole
    prompt blocks the forward does not write.

    Args:
        kv_cache: the device pool(s) the copies write (a layer is numbered as the model's).
    """

    def __init__(self, kv_cache: KVStorage) -> None:
        self._kv = kv_cache
        self._cuda = kv_cache.device.type == "cuda"
        self._stream: torch.cuda.Stream | None = None
        self._events: list[torch.cuda.Event] = []
        self._flags: list[threading.Event] = []
        self._failed: list[int] = []  # the layer whose CPU copy raised, this round
        self._waited: list[bool] = []
        self._thread: ThreadPoolExecutor | None = None
        self._future: Future[None] | None = None
        self._keep: list[torch.Tensor] = []  # host staging the CUDA copies still read

    def start(self, slab: torch.Tensor, slots: list[int], targets: list[LayerTarget]) -> None:
        """Start copying slab slots ``slots`` into the device, layer 0 first: model layer
        ``i``'s rows of them to ``targets[i]`` (:func:`~deepinfer_kit.cache.tiers.layer_targets.layer_targets`
        of the loads' blocks, distinct). Returns at once; the slab's slots must stay
        unchanged until :meth:`wait_all` returns. Mutates the device pool(s) (later)."""
        self.wait_all()
        layers = self._kv.num_layers
        self._waited = [False] * layers
        if self._cuda:
            self._start_cuda(slab, slots, targets)
            return
        self._flags = [threading.Event() for _ in range(layers)]
        self._failed = []
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="kv-load")
        self._future = self._thread.submit(self._copy_cpu, slab, slots, targets, self._flags, self._failed)

    def _copy_cpu(self, slab: torch.Tensor, slots: list[int], targets: list[LayerTarget],
                  flags: list[threading.Event], failed: list[int]) -> None:
        """The CPU thread's work: each layer's slots into its blocks, then its flag. A
        copy that raises is noted in ``failed`` (its layer) before every flag is set, so a
        wait for that layer or a later one finds it; the future holds the error."""
        layer = 0
        try:
            at = torch.tensor(slots, dtype=torch.int64)
            with torch.inference_mode():
                for layer, flag in enumerate(flags):
                    t = targets[layer]
                    if t.pool is not None:
                        t.pool.write_blocks(t.local, t.blocks, t.pick(slab[:, layer].index_select(0, at)))
                    flag.set()
        except BaseException:
            failed.append(layer)
            raise
        finally:
            for flag in flags:
                flag.set()

    def _start_cuda(self, slab: torch.Tensor, slots: list[int], targets: list[LayerTarget]) -> None:
        """Queue the layers' copies on the load stream, an event after each."""
        dev = self._kv.device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]
        at = torch.tensor(slots, dtype=torch.int64)
        staged = torch.empty((slab.shape[1], len(slots), *slab.shape[2:]), dtype=slab.dtype, pin_memory=True)
        staged.transpose(0, 1).copy_(slab.index_select(0, at))  # layer-major: each layer one contiguous copy
        self._keep.append(staged)
        self._stream.wait_stream(torch.cuda.current_stream(dev))
        for t in targets:  # made on the caller's stream, read on this one: not reused before
            for ids in (t.blocks, t.rows):
                if ids is not None:
                    ids.record_stream(self._stream)
        self._events = []
        with torch.cuda.stream(self._stream):
            for layer, t in enumerate(targets):
                if t.pool is not None:
                    t.pool.write_blocks(t.local, t.blocks, t.pick(staged[layer].to(dev, non_blocking=True)))
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(self._stream)
                self._events.append(event)

    def wait_layer(self, layer: int) -> None:
        """Order layer ``layer``'s copies before what the caller does next: on CUDA its
        stream waits for the layer's event; on the CPU block until the layer is copied.
        A no-op after the first call per layer, or with no loads started.

        Raises:
            Exception: what the CPU copy of this layer or an earlier one raised (once: the
                round is over; later waits of the round return at once).
        """
        if layer >= len(self._waited) or self._waited[layer]:
            return
        self._waited[layer] = True
        if self._cuda:
            if self._events:
                torch.cuda.current_stream(self._kv.device).wait_event(self._events[layer])
            return
        if self._flags:
            self._flags[layer].wait()
            if self._failed and self._failed[0] <= layer:
                self.wait_all()  # raises the copy's error

    def wait_all(self) -> None:
        """Order every started copy before what the caller does next (CUDA: a stream
        dependency on the last event; CPU: the thread's work joined), and forget the
        round. Raises what the CPU copy raised (once)."""
        self._waited = []
        if self._cuda:
            if self._events:
                torch.cuda.current_stream(self._kv.device).wait_event(self._events[-1])
            self._events = []
            return
        future, self._future, self._flags = self._future, None, []
        if future is not None:
            future.result()

    def release(self) -> None:
        """Drop the host staging of earlier rounds: called once the forward that read
        the loaded blocks has finished (the runner's ``get_finished``)."""
        self._keep.clear()

    def close(self) -> None:
        """Finish the copies in flight and stop the CPU thread."""
        try:
            self.wait_all()
        finally:
            if self._thread is not None:
                self._thread.shutdown(wait=True)
                self._thread = None
