"""The sampler's Triton kernels are batch-invariant as they are: ``row_norm``, ``full_draw``,
``candidate_draw`` and ``nucleus_draw`` (candidate path and whole-row fallback) give a row
bitwise the same result alone, among any other rows, at any place (under the
interpreter; natively on CUDA). One program per row, chunks sized by the vocabulary or
the candidate width only: nothing to fix."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from deepinfer_kit.sample.candidates import sorted_candidates

pytestmark = pytest.mark.triton

Draw = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]


def _ops() -> Any:
    from deepinfer_kit.sample import triton_ops

    return triton_ops


def _logits(rows: int, vocab: int, device: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits (flat rows, peaked rows, -inf holes) and per-row parameters."""
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(rows, vocab, generator=gen) * (0.02 + 4 * torch.rand(rows, 1, generator=gen))
    x[torch.rand(rows, vocab, generator=gen) < 0.2] = float("-inf")
    params = {
        "inv_t": (0.3 + 2 * torch.rand(rows, generator=gen)).float(),
        "min_p": torch.where(torch.rand(rows, generator=gen) < 0.5, 0.0,
                             0.2 * torch.rand(rows, generator=gen)),
        "p": torch.rand(rows, generator=gen).double().clamp(min=0.3),
        "u": torch.rand(rows, dtype=torch.float64, generator=gen),
        "k": torch.randint(1, 40, (rows,), generator=gen),
    }
    return x.to(device), {name: t.to(device) for name, t in params.items()}


def _rows_alike(draw: Draw, rows: int, device: str) -> None:
    """``draw(rows_index)`` over each row alone and over shuffled batches of 2, 5 and all
    rows: each row's results are the same bits."""
    alone = [draw(torch.tensor([r], device=device)) for r in range(rows)]
    gen = torch.Generator().manual_seed(0)
    for size in (2, 5, rows):
        pick = torch.randperm(rows, generator=gen)[:size].to(device)
        outs = draw(pick)
        for place, r in enumerate(pick.tolist()):
            for got, want in zip(outs, alone[r], strict=True):
                assert torch.equal(got[place : place + 1], want), (size, place)


def _check(device: str, vocab: int = 2500) -> None:
    ops = _ops()
    rows = 8
    x, prm = _logits(rows, vocab, device)
    _rows_alike(lambda r: (ops.row_norm(x, r, prm["inv_t"][r]),), rows, device)
    _rows_alike(lambda r: (ops.full_draw(x, r, prm["inv_t"][r], prm["min_p"][r], prm["u"][r]),), rows, device)
    vals, idx = sorted_candidates(x, torch.arange(rows, device=device))
    vals, idx = vals[:, :60].contiguous(), idx[:, :60].contiguous()
    z = ops.row_norm(x, torch.arange(rows, device=device), prm["inv_t"])
    _rows_alike(lambda r: ops.candidate_draw(vals[r], idx[r], prm["inv_t"][r], prm["k"][r], prm["p"][r],
                                             prm["min_p"][r], z[r], prm["u"][r]), rows, device)


def _nucleus(ops: Any, x: torch.Tensor, prm: dict[str, torch.Tensor]) -> Draw:
    return lambda r: (ops.nucleus_draw(x, r, prm["inv_t"][r], prm["p"][r], prm["min_p"][r], prm["u"][r]),)


def test_row_kernels_are_row_invariant() -> None:
    _check("cpu")


def test_nucleus_draw_is_row_invariant(monkeypatch: pytest.MonkeyPatch) -> None:
    """With 16 candidates, flat rows take the whole-row fallback and peaked rows settle
    in the candidates (both paths in one call)."""
    ops = _ops()
    monkeypatch.setattr(ops, "NUCLEUS_CANDIDATES", 16)
    x, prm = _logits(6, 300, "cpu")
    _rows_alike(_nucleus(ops, x, prm), 6, "cpu")


@pytest.mark.cuda
def test_row_kernels_are_row_invariant_on_cuda() -> None:
    _check("cuda", vocab=150_000)
    ops = _ops()
    x, prm = _logits(8, 150_000, "cuda")
    _rows_alike(_nucleus(ops, x, prm), 8, "cuda")
