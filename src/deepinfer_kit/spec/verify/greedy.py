"""GreedyVerifier: accept while the target's argmax equals the draft."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from deepinfer_kit._staging import host_to_device, to_device
from deepinfer_kit._kernels import Impl
from deepinfer_kit.sample.records import SamplingBatch
from deepinfer_kit.sample.vectorized import working_logits
from deepinfer_kit.spec.verify.kernels import select_verify_ops
from deepinfer_kit.spec.records import DraftProposal, VerifyResult
from deepinfer_kit.spec.verify.rows import flatten_verify

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

    def verify(
        self,
        proposal: DraftProposal,
        lengths: Sequence[int],
        target_logits: torch.Tensor,
        batch: SamplingBatch,
    ) -> VerifyResult:
        """See :meth:`DraftVerifier.verify`. One device-to-host copy of ``[2, R]`` ids.

        Raises:
            InvariantError: shapes that disagree or lengths out of range.
        """
        rows = flatten_verify(proposal, lengths, target_logits, batch)
        x = working_logits(rows.logits, rows.batch)
        dev = x.device
        num_acc, token = self._ops.greedy_verify(
            x,
            to_device(rows.offsets[:-1], torch.int64, dev),
            host_to_device(proposal.token_ids, dev).to(torch.int64),
            to_device([len(d) for d in rows.drafts], torch.int64, dev),
        )
        accepted, final = torch.stack((num_acc, token)).tolist()
        out = [d[:a] + [t] for d, a, t in zip(rows.drafts, accepted, final)]
        return VerifyResult(token_ids=out, num_accepted=accepted)


if TYPE_CHECKING:
    _check: type[DraftVerifier] = GreedyVerifier
