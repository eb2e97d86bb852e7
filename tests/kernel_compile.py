"""Compile a module's Triton kernels for a CUDA target (sm_90) ahead of time, without a GPU.

The interpreter (``TRITON_INTERPRET=1``, how the CPU tests run every kernel) runs plain
Python and accepts code the compiler rejects (``break``, type changes, specialisations of
size-1 arguments), so each kernel module also has a test that compiles every kernel, with
its integer arguments both general and equal to 1, in a process without the interpreter.
Only ptxas is needed; without it the test is skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import importlib

module = importlib.import_module({module!r})
for name, text in {signatures!r}.items():
    for ones in (False, True):
        signature = dict(item.split(":") for item in text.split())
        constants = dict({constants!r}[name])
        if ones:  # Triton specializes integer arguments equal to 1 into constants
            constants.update({{k: 1 for k in {one_args!r} if k in signature}})
        signature.update({{k: "constexpr" for k in constants}})
        source = ASTSource(fn=getattr(module, name), signature=signature, constexprs=constants)
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        assert "ptx" in kernel.asm, name
print("compiled")
"""


def assert_kernels_compile(
    module: str,
    signatures: dict[str, str],
    constants: dict[str, dict[str, int]],
    one_args: tuple[str, ...],
    env_extra: dict[str, str] | None = None,
) -> None:
    """Compile every kernel of ``module`` named in ``signatures`` (``"arg:type ..."``) with
    its ``constants`` (constexpr values), once as is and once with each of ``one_args``
    present in its signature set to 1; fail with the compiler's message."""
    script = _SCRIPT.format(module=module, signatures=signatures, constants=constants,
                            one_args=one_args)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_extra or {})
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    if done.returncode and "ptxas" in done.stderr.lower() and "not found" in done.stderr.lower():
        pytest.skip("no ptxas on this machine")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled" in done.stdout


class LaunchCapture:
    """Stands in for a Triton kernel: keeps each launch's arguments, runs nothing (to read
    the launch configuration a wrapper picks)."""

    def __init__(self) -> None:
        self.launches: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches.append((args, kwargs))

        return launch
