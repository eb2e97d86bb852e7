"""GreedyVerifier: accept while the target's argmax equals the draft."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepinfer_kit._staging import to_device
from deepinfer_kit._kernels import Impl
from deepinfer_kit.sample.vectorized import working_logits
from deepinfer_kit.spec.verify.kernels import select_verify_ops
from deepinfer_kit.spec.records import VerifyResult, VerifyRows
from deepinfer_kit.spec.verify.rows import check_rows

if TYPE_CHECKING:
    from deepinfer_kit.spec.protocols import DraftVerifier

__all__ = ["GreedyVerifier"]


class GreedyVerifier:
    """Greedy verification for every row, whatever its temperature.

    The target's choice at each row is the argmax of the logits after penalties and the
    ``min_tokens`` mask (lowest id on ties), exactly what the sampler picks for a greedy
    row; drafts are accepted while they equal it, then the target's own token follows.
    The spec-decoded output of a greedy request therefore equals plain greedy decoding.

    Args:
        impl: ``"ref"`` (torch), ``"triton"`` (one fused argmax-and-accept kernel), or
            ``"auto"`` (Triton when CUDA is available). Chosen once here.

    Raises:
        ConfigError: an unknown ``impl``.
        DeviceUnavailableError: ``impl="triton"`` without CUDA and without
            ``TRITON_INTERPRET=1``, or without Triton installed.
    """

    def __init__(self, impl: Impl = "auto") -> None:
        self._ops, self.impl = select_verify_ops(impl)

    def verify(self, rows: VerifyRows, draft_probs: torch.Tensor | None = None) -> VerifyResult:
        """See :meth:`DraftVerifier.verify` (``draft_probs`` is not read: greedy
        verification needs none). One device-to-host copy of ``[2, R]`` ids.

        Raises:
            InvariantError: rows that disagree.
        """
        width = check_rows(rows, None)
        x = working_logits(rows.logits, rows.batch)
        dev = x.device
        padded = [t for d in rows.drafts for t in (*d, *([0] * (width - len(d))))]
        num_acc, token = self._ops.greedy_verify(
            x,
            to_device(rows.offsets[:-1], torch.int64, dev),
            to_device(padded, torch.int64, dev).view(len(rows.drafts), width),
            to_device([len(d) for d in rows.drafts], torch.int64, dev),
        )
        accepted, final = torch.stack((num_acc, token)).tolist()
        out = [d[:a] + [t] for d, a, t in zip(rows.drafts, accepted, final)]
        return VerifyResult(token_ids=out, num_accepted=accepted)


if TYPE_CHECKING:
    _check: type[DraftVerifier] = GreedyVerifier
