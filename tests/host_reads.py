"""Host reads of device memory, found on a CPU run: what would make the host wait for the
GPU (a sync) if the same code ran on CUDA.

On CPU every tensor lives on the host, so ``torch.cuda.set_sync_debug_mode`` has nothing
to see. These guards stand in for it. An op *reads the host* when its result, or its
size, must come back to the host before Python can go on: ``tolist``, ``item``, ``bool``,
``nonzero``, a boolean-mask index, ``repeat_interleave`` without ``output_size``, a copy
to the CPU (``.cpu()``, ``.to("cpu")``; a ``.to(device)`` with a ``torch.device`` object
is taken to name the compute device, which on a CPU run is the host too).

- :func:`no_host_reads` (strict): every such op fails. For code whose inputs are all
  device tensors (the MoE layer).
- :class:`DeviceReads`: a whole step, where some tensors are built on the host on
  purpose (from lists, to be staged). It also records a tensor made from Python data
  straight on a device (``torch.tensor(values, device=dev)``): on CUDA that is a copy from
  pageable memory, which makes the host wait for the stream (stage through
  ``deepinfer_kit._staging.to_device``, whose CPU branch is this very call, instead). It tags every tensor a factory makes *without* a
  ``device`` argument (``torch.tensor(values)``, ``torch.arange(n)``) as host-born,
  propagates the tag through ops whose tensor inputs are all host-born, and drops it at
  a copy to a device (``.to(device)``). A read counts only when the tensor read is not
  host-born: on CUDA it would be device memory. Tensors made before the guard (weights,
  the KV pool, static buffers) count as device tensors.

Code that runs inside Triton's interpreter (``TRITON_INTERPRET=1``: kernels executed on
the host by design) is exempt from both.
"""

from __future__ import annotations

import os
import traceback
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

HOST_READS = {
    torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.numpy,
    torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__,
    torch.nonzero, torch.Tensor.nonzero, torch.bincount, torch.Tensor.bincount,
    torch.masked_select, torch.Tensor.masked_select, torch.unique, torch.Tensor.unique,
    torch.Tensor.__repr__, torch.Tensor.__format__,
}  # fmt: skip

FACTORIES = {
    torch.tensor, torch.as_tensor, torch.arange, torch.zeros, torch.ones, torch.empty, torch.full,
    torch.randn, torch.rand, torch.randint, torch.linspace, torch.eye,
}  # fmt: skip


def _bool_index(index: Any) -> torch.Tensor | None:
    """The boolean tensor inside an index expression, if any."""
    for i in index if isinstance(index, tuple) else (index,):
        if isinstance(i, torch.Tensor) and i.dtype == torch.bool:
            return i
    return None


def read_operand(func: Callable[..., Any], args: Any, kwargs: Any) -> torch.Tensor | None:
    """The tensor whose device contents ``func(*args, **kwargs)`` makes the host wait for,
    or ``None`` when the op reads nothing back."""
    if func in HOST_READS:
        return next((a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)), None)
    if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave) and "output_size" not in kwargs:
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0])
        return repeats if isinstance(repeats, torch.Tensor) else None
    if func is torch.Tensor.__getitem__:  # a boolean-mask result is sized on the host
        return _bool_index(args[1])
    if func is torch.Tensor.__setitem__ and isinstance(args[2], torch.Tensor):
        return _bool_index(args[1])  # index_put_ with a mask runs nonzero (a scalar is masked_fill_)
    if func is torch.Tensor.to:  # to the host by name; a device object is the compute device
        return args[0] if "cpu" in (*args[1:], kwargs.get("device")) else None
    return None


def _in_interpreter() -> bool:
    return any("/triton/" in frame.filename for frame in traceback.extract_stack())


class _NoHostReads(TorchFunctionMode):
    """Fails on any op that reads device memory on the host (see the module)."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if read_operand(func, args, kwargs) is not None and not _in_interpreter():
            raise AssertionError(f"host read on the sync-free path: {getattr(func, '__name__', func)}")
        return func(*args, **kwargs)


@contextmanager
def no_host_reads() -> Iterator[None]:
    """Strict: any host-reading op inside fails with ``AssertionError("host read …")``."""
    with _NoHostReads():
        yield


class DeviceReads(TorchFunctionMode):
    """Records, instead of raising, every host read of a tensor that is not host-born
    (see the module): ``reads`` counts ``(op, call site)``, the call site being the
    project's innermost frames. Used around a step, a record survives the engine's
    handling of a failed step (an exception would only fail the step)."""

    def __init__(self, package: str = "deepinfer_kit") -> None:
        super().__init__()
        self.package = package
        self.reads: Counter[tuple[str, str]] = Counter()
        self._host: dict[int, weakref.ref[torch.Tensor]] = {}

    def is_host(self, t: torch.Tensor) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def _tag(self, out: Any, host: bool) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                if host:
                    self._host[id(t)] = weakref.ref(t)
                else:
                    self._host.pop(id(t), None)

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        read = read_operand(func, args, kwargs)
        if read is not None and not self.is_host(read) and not _in_interpreter():
            self.reads[(getattr(func, "__name__", str(func)), self._site())] += 1
        if (func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None
                and not isinstance(args[0], torch.Tensor) and not self._staging()):
            self.reads[("tensor(values, device=...): a pageable copy", self._site())] += 1
        out = func(*args, **kwargs)
        if func in FACTORIES:
            self._tag(out, kwargs.get("device") is None)
        elif func in (torch.Tensor.to, torch.Tensor.cuda) and (
            kwargs.get("device") is not None
            or any(isinstance(a, (str, torch.device)) for a in args[1:])
        ):
            self._tag(out, False)  # a copy to a device (on CPU the same object: now a device tensor)
        else:
            inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            self._tag(out, bool(inputs) and all(self.is_host(a) for a in inputs))
        return out

    @staticmethod
    def _staging() -> bool:
        """True inside ``_staging.py`` (its non-CUDA branch builds on the device directly)."""
        return any(f.filename.endswith("deepinfer_kit/_staging.py") for f in traceback.extract_stack()[-4:])

    def _site(self) -> str:
        frames = [f for f in traceback.extract_stack() if f"/{self.package}/" in f.filename]
        return " < ".join(f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in reversed(frames[-3:]))
