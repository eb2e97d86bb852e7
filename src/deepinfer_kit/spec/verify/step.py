"""The draw of a round that verifies drafts: plain rows through the sampler, verified
chunks through the DraftVerifier, one token tensor for both (and their logprobs)."""

from __future__ import annotations

import attrs
import torch

from deepinfer_kit._staging import to_device
from deepinfer_kit.sample.logprobs import attach_logprobs
from deepinfer_kit.sample.protocols import Sampler
from deepinfer_kit.sample.records import SampleResult, SamplingBatch
from deepinfer_kit.spec.protocols import DraftVerifier
from deepinfer_kit.spec.records import VerifyRows

__all__ = ["VerifiedChunk", "verify_round"]


@attrs.frozen(slots=True)
class VerifiedChunk:
    """A chunk whose drafts are verified this round.

    Attributes:
        chunk: its index in the plan.
        first_row: its first sampling row; rows ``first_row + j`` for ``j <= len(drafts)``
            draw output position ``output_position + j`` from the logits after draft
            ``j - 1``, with ``drafts[:j]`` in their history.
        drafts: the drafts fed after the chunk's known tokens.
        draft_probs: ``[len(drafts), V]`` the distributions they were drawn from (a draft
            model's), or ``None`` for one-hot drafts.
    """

    chunk: int
    first_row: int
    drafts: tuple[int, ...]
    draft_probs: torch.Tensor | None = attrs.field(default=None, eq=False)


def verify_round(
    sampler: Sampler,
    verifier: DraftVerifier,
    logits: torch.Tensor,
    batch: SamplingBatch,
    verified: list[VerifiedChunk],
) -> tuple[SampleResult, list[int]]:
    """Draw every row of a round with verified chunks.

    Rows of no verified chunk are drawn by ``sampler`` (one call); the verified chunks'
    rows go to ``verifier`` as they are laid out (:class:`VerifyRows`: one gather of their
    logits rows and sampling rows, nothing re-expanded; ``draft_probs`` ``[R, G, V]`` when
    any chunk has them, one-hot rows for the chunks without), whose result is written back
    into the rows: row ``first_row + j`` holds the ``j``-th emitted token; rows past the
    emitted ones hold token 0 and are to be ignored. Logprobs are attached for all rows
    when any row asked for them.

    Args:
        logits: ``[N, V]`` float logits of every sampling row (non-finite rows already
            zeroed by the caller); not mutated.
        batch: ``N`` sampling rows.
        verified: the verified chunks, in row order.

    Returns:
        ``(result, emitted)``: tokens ``[N]`` int64 on ``logits``' device (plus logprob
        fields), and per verified chunk the number of tokens emitted (accepted + 1).
    """
    dev = logits.device
    num_rows = logits.shape[0]
    tokens = torch.zeros(num_rows, dtype=torch.int64, device=dev)
    in_verify = [False] * num_rows
    for v in verified:
        for j in range(len(v.drafts) + 1):
            in_verify[v.first_row + j] = True
    plain = [i for i, used in enumerate(in_verify) if not used]
    if plain:
        at = to_device(plain, torch.int64, dev)
        tokens[at] = sampler(logits.index_select(0, at), batch.select(plain)).token_ids
    width = max(len(v.drafts) for v in verified)
    index = [v.first_row + j for v in verified for j in range(len(v.drafts) + 1)]
    offsets = [0]
    for v in verified:
        offsets.append(offsets[-1] + len(v.drafts) + 1)
    rows = VerifyRows(logits.index_select(0, to_device(index, torch.int64, dev)), batch.select(index),
                      [list(v.drafts) for v in verified], offsets)
    result = verifier.verify(rows, _stack_probs(verified, width, logits.shape[1], dev))
    where = [v.first_row + j for v, toks in zip(verified, result.token_ids) for j in range(len(toks))]
    values = [t for toks in result.token_ids for t in toks]
    tokens[to_device(where, torch.int64, dev)] = to_device(values, torch.int64, dev)
    sampled = SampleResult(token_ids=tokens)
    if batch.max_logprobs >= 0:
        attach_logprobs(sampled, logits.to(torch.float32), batch.max_logprobs)
    return sampled, [len(toks) for toks in result.token_ids]


def _stack_probs(verified: list[VerifiedChunk], width: int, vocab: int,
                 device: torch.device) -> torch.Tensor | None:
    """``[R, G, V]`` float64 draft distributions of the verified chunks (zeros past each
    chunk's drafts; one-hot on the drafts of a chunk without probabilities), or ``None``
    when no chunk has any."""
    if all(v.draft_probs is None for v in verified):
        return None
    out = torch.zeros(len(verified), width, vocab, dtype=torch.float64, device=device)
    for r, v in enumerate(verified):
        n = len(v.drafts)
        if not n:
            continue
        if v.draft_probs is not None:
            out[r, :n] = v.draft_probs.to(device, torch.float64)
        else:
            ids = to_device(v.drafts, torch.int64, device)
            out[r, :n].scatter_(1, ids.unsqueeze(1), 1.0)
    return out
