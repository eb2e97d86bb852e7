"""VectorizedSampler: every row with its own parameters, grouped and drawn without per-row
Python loops over the vocabulary, with seeded rows batch-invariant.

One call: penalties and ``min_tokens`` masks (``penalties.py``); greedy rows take the
argmax; the other rows get one uniform each (``rng.py``) and are drawn by inverse CDF —
over the whole vocabulary in token order when they have no top-k / top-p (no sort); by
``nucleus_draw`` (a fixed number of passes over the row, whatever the nucleus width) when
they have top-p without top-k; over a candidate set sorted by logit when they have top-k
(``candidates.py``): a ``torch.topk`` wider than k (its ties at the last value settled
by token id on the device), a histogram threshold for a k above 2047, a full sort when
the width would reach V. Apart from the penalties' histories (host lists, staged) and
the threshold sets (sized on the host), a draw reads nothing back from the device, so
it queues behind the forward without waiting for it. Logprobs come from the raw logits
(``logprobs.py``).
"""

from __future__ import annotations

from collections.abc import Sized
from typing import TYPE_CHECKING, Literal

import attrs
import torch

from deepinfer_kit._kernels import Impl, resolve_impl
from deepinfer_kit._staging import to_device
from deepinfer_kit.errors import InvariantError
from deepinfer_kit.sample import ref_ops
from deepinfer_kit.sample.candidates import (
    block_maxima,
    settle_ties,
    sorted_candidates,
    threshold_candidates,
    topk_candidates,
)
from deepinfer_kit.sample.logprobs import attach_logprobs
from deepinfer_kit.sample.penalties import apply_penalties, needs_edits
from deepinfer_kit.sample.plan import PlanMemo, RowPlan
from deepinfer_kit.sample.protocols import DrawOps, Sampler
from deepinfer_kit.sample.records import SampleResult, SamplingBatch
from deepinfer_kit.sample.rng import row_uniforms

__all__ = ["VectorizedSampler", "check_batch", "working_logits"]


_THRESHOLD_MARGINS = (2.0, 8.0)  # subsample-rank safety factors of the two threshold tries


class _OpsByDevice:
    """:class:`DrawOps` that run the Triton kernels on CUDA logits and the torch ops on any
    other device (``impl="auto"`` on a machine with CUDA: an engine on ``device="cpu"``
    there must never hand CPU tensors to a compiled kernel)."""

    def __init__(self, fast: DrawOps) -> None:
        self.fast = fast

    def on(self, device: torch.device) -> DrawOps:
        """The ops for tensors on ``device``."""
        return self.fast if device.type == "cuda" else ref_ops

    def row_norm(self, x: torch.Tensor, rows: torch.Tensor, inv_t: torch.Tensor) -> torch.Tensor:
        """See :meth:`DrawOps.row_norm`."""
        return self.on(x.device).row_norm(x, rows, inv_t)

    def full_draw(self, x: torch.Tensor, rows: torch.Tensor, inv_t: torch.Tensor,
                  min_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """See :meth:`DrawOps.full_draw`."""
        return self.on(x.device).full_draw(x, rows, inv_t, min_p, u)

    def candidate_draw(self, vals: torch.Tensor, idx: torch.Tensor, inv_t: torch.Tensor,
                       k: torch.Tensor, p: torch.Tensor, min_p: torch.Tensor, z: torch.Tensor,
                       u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """See :meth:`DrawOps.candidate_draw`."""
        return self.on(vals.device).candidate_draw(vals, idx, inv_t, k, p, min_p, z, u)

    def nucleus_draw(self, x: torch.Tensor, rows: torch.Tensor, inv_t: torch.Tensor,
                     p: torch.Tensor, min_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """See :meth:`DrawOps.nucleus_draw`."""
        return self.on(x.device).nucleus_draw(x, rows, inv_t, p, min_p, u)


def _select_ops(impl: str) -> tuple[DrawOps, Literal["ref", "triton", "auto"]]:
    """``"auto"`` with CUDA and Triton present routes by the logits' device (name
    ``"auto"``); otherwise the one implementation ``resolve_impl`` picks."""
    if resolve_impl(impl, on_cuda=torch.cuda.is_available()) == "ref":
        return ref_ops, "ref"
    import deepinfer_kit.sample.triton_ops as triton_ops

    if impl == "auto":
        return _OpsByDevice(triton_ops), "auto"
    return triton_ops, "triton"


def check_batch(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Raise :class:`InvariantError` unless ``logits`` is ``[N, V]`` with ``V >= 1`` and every
    per-row list of ``batch`` has ``N`` entries."""
    if logits.dim() != 2 or logits.shape[1] < 1:
        raise InvariantError(f"logits must be [N, V] with V >= 1, got shape {tuple(logits.shape)}")
    n = logits.shape[0]
    fields: dict[str, Sized] = {
        "params": batch.params,
        "seeds": batch.seeds,
        "positions": batch.positions,
        "prompt_token_ids": batch.prompt_token_ids,
        "output_token_ids": batch.output_token_ids,
        "eos_token_ids": batch.eos_token_ids,
    }
    for name, values in fields.items():
        if len(values) != n:
            raise InvariantError(f"batch.{name} has {len(values)} rows, logits have {n}")


def working_logits(logits: torch.Tensor, batch: SamplingBatch, *, may_edit: bool = True) -> torch.Tensor:
    """``[N, V]`` contiguous float32 logits with penalties and ``min_tokens`` masks applied.

    ``logits`` itself is never mutated: it is copied whenever an edit is needed (or when it
    is not contiguous float32). ``may_edit=False``: the caller knows no row has penalties
    or a ``min_tokens`` (:class:`PlanMemo`), so the rows are not checked.
    """
    x = logits.to(torch.float32).contiguous()
    if may_edit and needs_edits(batch):
        if x.data_ptr() == logits.data_ptr():
            x = x.clone()
        apply_penalties(x, batch)
    return x


@attrs.define(slots=True, eq=False)
class _RowTensors:
    """Per-row draw parameters of the whole batch, on the logits' device (``[N]`` each)."""

    inv_t: torch.Tensor  # float32
    k: torch.Tensor  # int64, V when off
    p: torch.Tensor  # float64, 1 when off
    min_p: torch.Tensor  # float32
    u: torch.Tensor  # float64 uniforms (0 for greedy rows)


class VectorizedSampler:
    """The batch :class:`~deepinfer_kit.sample.Sampler`: per-row parameters, no vocabulary
    sort for rows that do not need one, seeded rows batch-invariant.

    Args:
        impl: ``"ref"`` (torch ops), ``"triton"`` (Triton kernels for the draw and the
            filters), or ``"auto"``: on a machine with CUDA and Triton, the kernels for
            logits on a CUDA device and the torch ops for logits elsewhere (``impl`` then
            reads ``"auto"``); without them, ``"ref"``. Chosen once here.

    Raises:
        ConfigError: an unknown ``impl``.
        DeviceUnavailableError: ``impl="triton"`` without CUDA and without
            ``TRITON_INTERPRET=1``, or without Triton installed.
    """

    def __init__(self, impl: Impl = "auto") -> None:
        self._ops, self.impl = _select_ops(impl)
        self._plans = PlanMemo()

    def ops_for(self, device: torch.device) -> DrawOps:
        """The draw ops this sampler runs on logits on ``device`` (warm-up calls them)."""
        ops = self._ops
        return ops.on(device) if isinstance(ops, _OpsByDevice) else ops

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
        """Draw one token per row; see :meth:`Sampler.__call__` for the contract.

        Order per row: penalties, ``min_tokens`` mask, temperature, top-k, top-p, min-p,
        draw. A row left with no finite logit draws token 0 (the argmax). Consumes one
        double per unseeded sampled row from ``batch.generator``.

        Raises:
            InvariantError: mismatched shapes, or a history token outside ``[0, V)``.
        """
        check_batch(logits, batch)
        vocab = logits.shape[1]
        plan, may_edit = self._plans.plan(batch, vocab)
        x = working_logits(logits, batch, may_edit=may_edit)
        if len(plan.greedy) == logits.shape[0]:  # all greedy: the argmax, no row gathers
            tokens = x.argmax(dim=-1)
        else:
            tokens = torch.zeros(logits.shape[0], dtype=torch.int64, device=x.device)
            if plan.greedy:
                rows = _index(plan.greedy, x.device)
                tokens[rows] = x[rows].argmax(dim=-1)
            sampled = plan.sampled
            self._draw(x, plan, self._row_tensors(x, plan, batch, sampled), tokens)
        result = SampleResult(token_ids=tokens)
        if batch.max_logprobs >= 0:
            attach_logprobs(result, logits.to(torch.float32), batch.max_logprobs)
        return result

    def _row_tensors(
        self, x: torch.Tensor, plan: RowPlan, batch: SamplingBatch, sampled: list[int]
    ) -> _RowTensors:
        dev = x.device
        u = torch.zeros(x.shape[0], dtype=torch.float64, device=dev)
        u[_index(sampled, dev)] = row_uniforms(
            [batch.seeds[i] for i in sampled],
            [batch.positions[i] for i in sampled],
            batch.generator,
            dev,
        )
        return _RowTensors(
            inv_t=to_device(plan.inv_t, torch.float32, dev),
            k=to_device(plan.top_k, torch.int64, dev),
            p=to_device(plan.top_p, torch.float64, dev),
            min_p=to_device(plan.min_p, torch.float32, dev),
            u=u,
        )

    def _draw(self, x: torch.Tensor, plan: RowPlan, t: _RowTensors, tokens: torch.Tensor) -> None:
        dev = x.device
        if plan.full:
            rows = _index(plan.full, dev)
            tokens[rows] = self._ops.full_draw(x, rows, t.inv_t[rows], t.min_p[rows], t.u[rows])
        if plan.nucleus:
            rows = _index(plan.nucleus, dev)
            tokens[rows] = self._ops.nucleus_draw(
                x, rows, t.inv_t[rows], t.p[rows], t.min_p[rows], t.u[rows]
            )
        # rows a threshold set could not settle (large k only: it sizes sets on the host)
        unsettled = self._threshold_stage(x, _index(plan.threshold, dev), t, tokens)
        topk_rows = _index([i for group in plan.topk.values() for i in group], dev)
        maxima = block_maxima(x, topk_rows) if topk_rows.numel() else x[:0]
        start = 0
        for width, group in plan.topk.items():
            end = start + len(group)
            rows = topk_rows[start:end]
            vals, idx = topk_candidates(x, rows, width, maxima[start:end])
            start = end
            tokens[rows] = self._topk_draw(x, rows, vals, idx, t)
        rows = torch.cat([_index(plan.sort, dev), unsettled])
        if rows.numel():
            vals, idx = sorted_candidates(x, rows)
            tokens[rows] = self._candidate_draw(vals, idx, rows, t)[0]

    def _topk_draw(
        self, x: torch.Tensor, rows: torch.Tensor, vals: torch.Tensor, idx: torch.Tensor, t: _RowTensors
    ) -> torch.Tensor:
        """The tokens of top-k ``rows`` from their ``torch.topk`` candidates (wider than k,
        so top-p's mass is always reached inside): exact once the run tied at the last
        value is settled by token id (:func:`settle_ties`). On the Triton ops (the device
        path) every row is settled, fixed shapes, nothing read back; on the torch
        reference (the host path, where a read is free) only the rows whose kept set
        reaches the last value, usually none. The same tokens either way."""
        if self.ops_for(x.device) is not ref_ops:
            return self._candidate_draw(vals, settle_ties(x, rows, vals, idx), rows, t)[0]
        tok, kept = self._candidate_draw(vals, idx, rows, t)
        at_cut = vals.gather(1, (kept - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        tied = ((kept > 0) & (at_cut == vals[:, -1])).nonzero().squeeze(1)
        if tied.numel():
            some, vals, idx = rows[tied], vals[tied], idx[tied]
            tok[tied] = self._candidate_draw(vals, settle_ties(x, some, vals, idx), some, t)[0]
        return tok

    def _threshold_stage(
        self, x: torch.Tensor, rows: torch.Tensor, t: _RowTensors, tokens: torch.Tensor
    ) -> torch.Tensor:
        """Draw top-k ``rows`` from threshold candidate sets (a tight try, then a generous
        one); return the rows still unresolved."""
        for margin in _THRESHOLD_MARGINS:
            if not rows.numel():
                break
            vals, idx, ok = threshold_candidates(x, rows, t.k[rows], margin)
            tok, kept = self._candidate_draw(vals, idx, rows, t)
            exact = ok & (kept >= 0)
            tokens[rows[exact]] = tok[exact]
            rows = rows[~exact]
        return rows

    def _candidate_draw(
        self, vals: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor, t: _RowTensors
    ) -> tuple[torch.Tensor, torch.Tensor]:
        z = torch.zeros_like(t.p[rows])  # top-p rows here have top-k: renormalized over it
        return self._ops.candidate_draw(
            vals, idx, t.inv_t[rows], t.k[rows], t.p[rows], t.min_p[rows], z, t.u[rows]
        )


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return to_device(rows, torch.int64, device)


if TYPE_CHECKING:
    _check: type[Sampler] = VectorizedSampler
