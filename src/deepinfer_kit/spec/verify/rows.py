"""Verification rows: one sampling row per verified position of each request.

Request ``r`` verifying ``ℓ_r`` drafts owns ``ℓ_r + 1`` rows: row ``j`` draws output
position ``positions[r] + j`` from the target's logits after draft ``j - 1``, with the
drafts before it counted as generated (penalties, ``min_tokens``). Both verifiers and
the engine's runner lay rows out this way.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from deepinfer_kit._staging import to_device
from deepinfer_kit.errors import InvariantError
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sample.records import SamplingBatch
from typing import TYPE_CHECKING
from deepinfer_kit.spec.records import DraftProposal, VerifyResult, VerifyRows

if TYPE_CHECKING:
    from deepinfer_kit.spec.protocols import DraftVerifier

__all__ = ["VerifyRows", "expand_rows", "flatten_verify", "verify_padded", "check_rows", "accept_matching",
           "row_histories"]


def row_histories(history: Sequence[int], drafts: Sequence[int]) -> list[tuple[int, ...]]:
    """The token history of each of a request's ``len(drafts) + 1`` verification rows: row
    ``j`` sees ``history + drafts[:j]`` (the module's row rule, stated once: the verifiers
    and the runner's round layout both read it). O(len(drafts)²)."""
    base = tuple(history)
    return [base + tuple(drafts[:j]) if j else base for j in range(len(drafts) + 1)]


def expand_rows(batch: SamplingBatch, drafts: Sequence[Sequence[int]]) -> SamplingBatch:
    """``sum(len(d) + 1)`` rows from one row per request: row ``(r, j)`` has request
    ``r``'s parameters and seed, output position ``positions[r] + j`` and history
    ``output_token_ids[r] + drafts[r][:j]``. O(sum ℓ_r²) for the history copies."""
    params: list[SamplingParams] = []
    seeds: list[int | None] = []
    pos: list[int] = []
    prompts: list[Sequence[int]] = []
    outs: list[Sequence[int]] = []
    eos: list[int | None] = []
    for r, d in enumerate(drafts):
        for j, history in enumerate(row_histories(batch.output_token_ids[r], d)):
            params.append(batch.params[r])
            seeds.append(batch.seeds[r])
            pos.append(batch.positions[r] + j)
            prompts.append(batch.prompt_token_ids[r])
            outs.append(history)
            eos.append(batch.eos_token_ids[r])
    return SamplingBatch(params, seeds, pos, prompts, outs, eos, batch.generator)


def flatten_verify(
    proposal: DraftProposal,
    lengths: Sequence[int],
    target_logits: torch.Tensor,
    batch: SamplingBatch,
) -> VerifyRows:
    """The flat rows (:class:`VerifyRows`) of drafts held as a :class:`DraftProposal` with
    ``[R, G + 1, V]`` target logits and one sampling row per request.

    Raises:
        InvariantError: shapes that disagree, or a length outside ``[0, num_drafted[r]]``.
    """
    num_req = len(lengths)
    width = proposal.token_ids.shape[1] if proposal.token_ids.dim() == 2 else -1
    if (
        width < 0
        or proposal.token_ids.shape[0] != num_req
        or len(proposal.num_drafted) != num_req
        or len(batch) != num_req
        or target_logits.dim() != 3
        or tuple(target_logits.shape[:2]) != (num_req, width + 1)
    ):
        raise InvariantError(
            f"verify: token_ids {tuple(proposal.token_ids.shape)}, target_logits "
            f"{tuple(target_logits.shape)}, {len(proposal.num_drafted)} num_drafted, "
            f"{len(batch)} sampling rows for {num_req} lengths; need [R, G], [R, G + 1, V], R, R"
        )
    for r, (n, m) in enumerate(zip(lengths, proposal.num_drafted)):
        if not 0 <= n <= m <= width:
            raise InvariantError(f"verify: request {r} verifies {n} of {m} drafts (width {width})")
    host: list[list[int]] = proposal.token_ids.tolist() if width else [[] for _ in lengths]
    drafts = [row[:n] for row, n in zip(host, lengths)]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n + 1)
    rows = to_device([r * (width + 1) + j for r, n in enumerate(lengths) for j in range(n + 1)],
                     torch.int64, target_logits.device)
    flat = target_logits.reshape(num_req * (width + 1), target_logits.shape[2]).index_select(0, rows)
    return VerifyRows(flat, expand_rows(batch, drafts), drafts, offsets)


def check_rows(rows: VerifyRows, draft_probs: torch.Tensor | None) -> int:
    """Check a verification's flat rows (and draft distributions) agree; return ``G``, the
    most drafts of a request.

    Raises:
        InvariantError: offsets that do not step by ``len(drafts[r]) + 1`` from 0 to the
            rows, a batch of another length, or ``draft_probs`` not ``[R, >= G, V]``.
    """
    num_req = len(rows.drafts)
    width = max((len(d) for d in rows.drafts), default=0)
    steps = [rows.offsets[r + 1] - rows.offsets[r] for r in range(len(rows.offsets) - 1)]
    m = rows.logits.shape[0] if rows.logits.dim() == 2 else -1
    if (len(rows.offsets) != num_req + 1 or rows.offsets[:1] != [0] or steps != [len(d) + 1 for d in rows.drafts]
            or rows.offsets[-1] != m or len(rows.batch) != m):
        raise InvariantError(
            f"verify: offsets {rows.offsets[:8]}..., logits {tuple(rows.logits.shape)}, {len(rows.batch)} "
            f"sampling rows for {num_req} requests' drafts of lengths {[len(d) for d in rows.drafts][:8]}")
    if draft_probs is not None and (draft_probs.dim() != 3 or draft_probs.shape[0] != num_req
                                    or draft_probs.shape[1] < width or draft_probs.shape[2] != rows.logits.shape[1]):
        raise InvariantError(f"verify: draft_probs {tuple(draft_probs.shape)}, need [{num_req}, >= {width}, "
                             f"{rows.logits.shape[1]}]")
    return width


def verify_padded(verifier: DraftVerifier, proposal: DraftProposal, lengths: Sequence[int],
                  target_logits: torch.Tensor, batch: SamplingBatch) -> VerifyResult:
    """``verifier`` on drafts held as a :class:`DraftProposal` with ``[R, G + 1, V]``
    target logits and one sampling row per request (the first ``lengths[r]`` drafts of
    each verified): flattened by :func:`flatten_verify`, then ``verifier.verify``.

    Raises:
        InvariantError: as :func:`flatten_verify`, or what the verifier raises.
    """
    probs = proposal.draft_probs
    return verifier.verify(flatten_verify(proposal, lengths, target_logits, batch), probs)


def accept_matching(rows: VerifyRows, tokens: list[int]) -> VerifyResult:
    """Accept each request's drafts while the target's token at that row equals the
    draft; then emit the target's token at the first mismatch (or the bonus row).

    With ``tokens`` drawn by the sampler from each row, this is exact rejection sampling
    for a deterministic (one-hot) draft: ``d`` is accepted with probability ``p_t(d)``
    and, on rejection, the token follows ``p_t`` without ``d`` renormalised — the
    residual ``max(0, p_t - onehot(d))``. ``tokens`` is ``[M]``, request-major.
    """
    out: list[list[int]] = []
    accepted: list[int] = []
    for r, d in enumerate(rows.drafts):
        base = rows.offsets[r]
        a = 0
        while a < len(d) and tokens[base + a] == d[a]:
            a += 1
        out.append(d[:a] + [tokens[base + a]])
        accepted.append(a)
    return VerifyResult(token_ids=out, num_accepted=accepted)
