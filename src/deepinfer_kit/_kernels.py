"""Choosing between a torch reference op and its Triton kernel, once, at construction."""

from __future__ import annotations

import importlib.util
import os
from typing import Literal

from deepinfer_kit.errors import ConfigError, DeviceUnavailableError

__all__ = ["Impl", "resolve_impl"]

Impl = Literal["auto", "ref", "triton"]


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_impl(impl: str, *, on_cuda: bool, field: str = "impl") -> Literal["ref", "triton"]:
    """The implementation a component will use for its whole life.

    ``"auto"`` picks Triton only on CUDA with Triton installed, else the reference.
    ``"triton"`` runs natively on CUDA, or on the CPU under the Triton interpreter
    (``TRITON_INTERPRET=1`` set before triton is first imported). Imports nothing.

    Args:
        impl: ``"auto"``, ``"ref"`` or ``"triton"``.
        on_cuda: whether the component's tensors live on a CUDA device.
        field: the parameter name used in error messages.

    Raises:
        ConfigError: ``impl`` is none of the three.
        DeviceUnavailableError: ``"triton"`` without CUDA and without the interpreter, or
            without Triton installed.
    """
    if impl not in ("auto", "ref", "triton"):
        raise ConfigError(f"{field} must be one of ['auto', 'ref', 'triton'], got {impl!r}")
    if impl == "ref":
        return "ref"
    if impl == "auto":
        return "triton" if on_cuda and _triton_installed() else "ref"
    if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise DeviceUnavailableError(f"{field}='triton' needs CUDA or TRITON_INTERPRET=1")
    if not _triton_installed():
        raise DeviceUnavailableError(f"{field}='triton' needs Triton installed")
    return "triton"
