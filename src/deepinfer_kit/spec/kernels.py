"""Choosing the verification ops, torch reference or Triton kernels, once per verifier."""

from __future__ import annotations

from typing import Literal, Protocol

import torch

from deepinfer_kit._kernels import resolve_impl
from deepinfer_kit.spec import ref_ops

__all__ = ["VerifyOps", "select_verify_ops"]


class VerifyOps(Protocol):
    """The verification ops: ``spec.ref_ops`` or ``spec.triton_ops`` (same signatures)."""

    def greedy_verify(self, logits: torch.Tensor, offsets: torch.Tensor, draft_ids: torch.Tensor,
                      lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """See :func:`deepinfer_kit.spec.ref_ops.greedy_verify`."""
        ...

    def rejection_sample(self, target: torch.Tensor, draft_probs: torch.Tensor,
                         draft_ids: torch.Tensor, lengths: torch.Tensor, u_accept: torch.Tensor,
                         u_draw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """See :func:`deepinfer_kit.spec.ref_ops.rejection_sample`."""
        ...


def select_verify_ops(impl: str) -> tuple[VerifyOps, Literal["ref", "triton"]]:
    """The ops of ``impl`` (``"auto"``: Triton when CUDA is available) and its resolved name.

    Imports ``spec.triton_ops`` (and so Triton) only when it is chosen.

    Raises:
        ConfigError: an unknown ``impl``.
        DeviceUnavailableError: ``"triton"`` without CUDA and without ``TRITON_INTERPRET=1``,
            or without Triton installed.
    """
    if resolve_impl(impl, on_cuda=torch.cuda.is_available()) == "ref":
        return ref_ops, "ref"
    import deepinfer_kit.spec.triton_ops as triton_ops

    return triton_ops, "triton"
