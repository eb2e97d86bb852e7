"""Choosing the verification ops, torch reference or Triton kernels, once per verifier."""

from __future__ import annotations

from typing import Literal, Protocol

import torch

from deepinfer_kit._kernels import resolve_impl
from deepinfer_kit.spec.verify import ref_ops

__all__ = ["VerifyOps", "select_verify_ops"]


class VerifyOps(Protocol):
    """The verification ops: ``spec.ref_ops`` or ``spec.triton_ops`` (same signatures)."""

    def greedy_verify(self, logits: torch.Tensor, offsets: torch.Tensor, draft_ids: torch.Tensor,
                      lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """See :func:`deepinfer_kit.spec.verify.ref_ops.greedy_verify`."""
        ...

    def rejection_sample(self, target: torch.Tensor, draft_probs: torch.Tensor,
                         draft_ids: torch.Tensor, lengths: torch.Tensor, u_accept: torch.Tensor,
                         u_draw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """See :func:`deepinfer_kit.spec.verify.ref_ops.rejection_sample`."""
        ...


class _VerifyOpsByDevice:
    """:class:`VerifyOps` that run the Triton kernels on CUDA logits and the torch ops on
    any other device (``"auto"`` on a machine with CUDA: a ``device="cpu"`` engine there
    must never hand CPU tensors to a compiled kernel)."""

    def __init__(self, fast: VerifyOps) -> None:
        self.fast = fast

    def on(self, device: torch.device) -> VerifyOps:
        """The ops for tensors on ``device``."""
        return self.fast if device.type == "cuda" else ref_ops

    def greedy_verify(self, logits: torch.Tensor, offsets: torch.Tensor, draft_ids: torch.Tensor,
                      lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """See :func:`deepinfer_kit.spec.verify.ref_ops.greedy_verify`."""
        return self.on(logits.device).greedy_verify(logits, offsets, draft_ids, lengths)

    def rejection_sample(self, target: torch.Tensor, draft_probs: torch.Tensor,
                         draft_ids: torch.Tensor, lengths: torch.Tensor, u_accept: torch.Tensor,
                         u_draw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """See :func:`deepinfer_kit.spec.verify.ref_ops.rejection_sample`."""
        return self.on(target.device).rejection_sample(
            target, draft_probs, draft_ids, lengths, u_accept, u_draw)


def select_verify_ops(impl: str) -> tuple[VerifyOps, Literal["ref", "triton", "auto"]]:
    """The ops of ``impl`` and its resolved name. ``"auto"`` on a machine with CUDA and
    Triton routes by the logits' device (name ``"auto"``: the kernels for CUDA tensors, the
    torch ops for others); without them it is ``"ref"``.

    Imports ``spec.triton_ops`` (and so Triton) only when it may be used.

    Raises:
        ConfigError: an unknown ``impl``.
        DeviceUnavailableError: ``"triton"`` without CUDA and without ``TRITON_INTERPRET=1``,
            or without Triton installed.
    """
    if resolve_impl(impl, on_cuda=torch.cuda.is_available()) == "ref":
        return ref_ops, "ref"
    import deepinfer_kit.spec.verify.triton_ops as triton_ops

    if impl == "auto":
        return _VerifyOpsByDevice(triton_ops), "auto"
    return triton_ops, "triton"
