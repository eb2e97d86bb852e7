"""Triton specialisation keys of the project's kernel launches, computed with Triton's own
binder, and a count of the variants compiled so far: what warm-up must cover, and what a
served step must never add.

Triton compiles one variant of a kernel per key: its constexpr values, its launch options
(``num_warps``, ``num_stages``) and, per other argument, the type plus a specialisation —
a pointer whose ``data_ptr() % 16 == 0``, an integer equal to 1 (made a constant) or
divisible by 16. The key is a function of the arguments only, so it is computed the same
on a CPU under the interpreter as on a GPU: a CPU test can prove that warm-up launched
every key a workload launches.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["LaunchKey", "compiled_keys", "compiled_variants", "launch_key", "record_launches",
           "shared_memory_bytes"]

LaunchKey = tuple[str, str]  # (kernel's qualified name, Triton's cache key of the launch)

_PREFIX = "deepinfer_kit"
_binders: dict[Callable[..., Any], Callable[..., Any]] = {}


def _jit_function(kernel: Any) -> Any:
    """A ``JITFunction`` of ``kernel`` (itself natively; rebuilt from the Python function,
    with the decorator's specialisation arguments, under the interpreter)."""
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        return kernel
    kept = ("do_not_specialize", "do_not_specialize_on_alignment")
    given = getattr(kernel, "kwargs", {})  # the interpreter keeps the decorator's arguments
    return JITFunction(kernel.fn, **{k: v for k, v in given.items() if k in kept})


def _python_fn(kernel: Any) -> Callable[..., Any]:
    """The Python function under a ``JITFunction`` or an ``InterpretedFunction``."""
    fn: Callable[..., Any] = kernel.fn
    return fn


def launch_key(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> LaunchKey:
    """The key Triton files the launch ``kernel[grid](*args, **kwargs)`` under.

    Uses Triton's binder (``create_function_from_signature`` with the base backend's
    specialisation, which the CUDA backend inherits) over a ``JITFunction`` of the
    kernel's Python function, so it works for a compiled kernel and for one under the
    interpreter alike; reads only ``data_ptr()``, dtypes and values. Raises what Triton's
    binder raises on arguments that do not fit the signature.
    """
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import compute_cache_key, create_function_from_signature

    fn = _python_fn(kernel)
    binder = _binders.get(fn)
    if binder is None:
        jit = _jit_function(kernel)
        binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)
        _binders[fn] = binder
    _, specialization, options = binder(*args, **kwargs)
    return f"{fn.__module__}.{fn.__qualname__}", str(compute_cache_key({}, specialization, options))


@contextmanager
def record_launches() -> Iterator[Counter[LaunchKey]]:
    """Within the block, count every launch of a ``deepinfer_kit`` Triton kernel by its
    :func:`launch_key` (from any thread), then launch it as usual.

    Patches ``run`` of Triton's ``JITFunction`` and, when the interpreter is loaded,
    ``InterpretedFunction`` for the duration of the block (not re-entrant: one recording
    at a time). Yields the counter it fills.
    """
    from triton.runtime.jit import JITFunction

    classes: list[type] = [JITFunction]
    interpreter = sys.modules.get("triton.runtime.interpreter")
    if interpreter is not None:
        classes.append(interpreter.InterpretedFunction)
    seen: Counter[LaunchKey] = Counter()
    lock = threading.Lock()
    originals = {cls: cls.__dict__["run"] for cls in classes}

    def patched(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            if not warmup and _python_fn(self).__module__.startswith(_PREFIX):
                key = launch_key(self, args, kwargs)
                with lock:
                    seen[key] += 1
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)

        return run

    for cls, original in originals.items():
        setattr(cls, "run", patched(original))
    try:
        yield seen
    finally:
        for cls, original in originals.items():
            setattr(cls, "run", original)


def compiled_keys() -> dict[str, set[str]]:
    """The cache keys of the compiled variants of every loaded ``deepinfer_kit`` Triton
    kernel, by the kernel's qualified name (each kernel once, whichever modules import
    it; kernels with no variant left out; empty under the interpreter, which compiles
    nothing). Diff two reads to see what compiled in between."""
    from triton.runtime.jit import JITFunction

    found: dict[str, set[str]] = {}
    seen: set[int] = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith(_PREFIX) or module is None:
            continue
        for value in list(vars(module).values()):
            if not isinstance(value, JITFunction) or id(value) in seen:
                continue
            seen.add(id(value))
            caches = getattr(value, "device_caches", {})
            keys = {str(key) for entry in list(caches.values()) for key in list(entry[0])}
            if keys:
                fn = _python_fn(value)
                found[f"{fn.__module__}.{fn.__qualname__}"] = keys
    return found


def compiled_variants() -> int:
    """Compiled variants held by every loaded ``deepinfer_kit`` Triton kernel (0 under the
    interpreter, which compiles nothing), each kernel counted once. Read it after warm-up
    and after serving: any growth is a compilation inside a step (:func:`compiled_keys`
    says which)."""
    return sum(len(keys) for keys in compiled_keys().values())


def shared_memory_bytes(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                        capability: int = 90) -> int:
    """Shared memory (bytes per program) the launch ``kernel[grid](*args, **kwargs)`` needs
    on an NVIDIA GPU of compute ``capability`` (90: H100/H200), as Triton reports it:
    the launch is bound and compiled by Triton's CUDA backend for that target (no GPU
    needed: the compiler and ``ptxas`` ship with Triton), with the runtime's default
    options (``num_stages``, ``num_warps``) unless ``kwargs`` sets them.

    Takes seconds to a minute per call. Tensors in ``args`` may live on the CPU: only
    their dtypes and alignment are read.

    Raises:
        What Triton's compiler raises (an ``OutOfResources`` is not raised here: that
        check runs at load time on a device; compare the result with the device's limit).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource
    from triton.runtime.jit import create_function_from_signature

    jit = _jit_function(kernel)
    target = GPUTarget("cuda", capability, 32)
    backend = CUDABackend(target)
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options_, signature, constexprs, attrs = jit._pack_args(backend, dict(kwargs), bound,
                                                            specialization, options)
    compiled = triton.compile(ASTSource(jit, signature, constexprs, attrs), target=target,
                              options=options_.__dict__)
    return int(compiled.metadata.shared)
