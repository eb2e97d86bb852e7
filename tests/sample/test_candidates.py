"""Candidate sets: exact top-W values from the block pre-selection, value-closed threshold
sets that hold what was asked, canonical order (value descending, ties by token id)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kit.sample.candidates import (
    SUBSAMPLE_STRIDE,
    TOPK_BLOCK,
    block_maxima,
    settle_ties,
    sorted_candidates,
    threshold_candidates,
    topk_candidates,
)


def _logits(seed: int, rows: int, vocab: int, ties: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen) * 2
    if ties:
        x = torch.round(x * 2) / 2  # few distinct values: ties everywhere
    x[0, : vocab // 2] = float("-inf")
    return x


def _is_canonical(vals: torch.Tensor, idx: torch.Tensor) -> bool:
    dv = vals[:, 1:] - vals[:, :-1]
    same = vals[:, 1:] == vals[:, :-1]
    finite = torch.isfinite(vals[:, 1:])
    return bool(((dv <= 0) | ~finite).all() and ((idx[:, 1:] > idx[:, :-1]) | ~same | ~finite).all())


@pytest.mark.parametrize("vocab", [4096 + 37, 9000])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("width", [1, 64, 130])
def test_block_preselection_gives_the_exact_top_values(vocab: int, ties: bool, width: int) -> None:
    x = _logits(vocab + width, 7, vocab, ties)
    rows = torch.tensor([0, 3, 6, 2])
    maxima = block_maxima(x, rows)
    assert maxima.shape == (4, -(-vocab // TOPK_BLOCK))
    vals, idx = topk_candidates(x, rows, width, maxima)
    full_vals, full_idx = sorted_candidates(x, rows)
    assert torch.equal(vals, full_vals[:, :width])
    assert torch.equal(x[rows].gather(1, idx), vals)
    assert _is_canonical(vals, idx)
    strictly_above = vals > vals[:, -1:]
    assert torch.equal(idx[strictly_above], full_idx[:, :width][strictly_above])
    assert torch.equal(settle_ties(x, rows, vals, idx), full_idx[:, :width])  # ties too


def test_block_maxima_reads_few_rows_or_all_rows_alike() -> None:
    x = _logits(1, 16, 1000, False)
    few, many = torch.tensor([3]), torch.arange(16)
    assert torch.equal(block_maxima(x, few), block_maxima(x, many)[3:4])


@pytest.mark.parametrize("margin", [1.05, 2.0, 8.0])
def test_threshold_sets_are_value_closed_and_sufficient(margin: float) -> None:
    gen = torch.Generator().manual_seed(3)
    vocab = 6000
    x = torch.randn(6, vocab, generator=gen) * torch.tensor([[0.5], [1], [2], [3], [4], [6]])
    rows = torch.arange(6)
    need_count = torch.tensor([4097, 300, 700, 5000, 3, 1200])
    vals, idx, ok = threshold_candidates(x, rows, need_count, margin)
    assert _is_canonical(vals, idx)
    for r in range(6):
        members = idx[r][torch.isfinite(vals[r])]
        assert len(set(members.tolist())) == members.numel()
        if not ok[r]:
            continue
        lowest = vals[r][torch.isfinite(vals[r])].min()
        assert int((x[r] >= lowest).sum()) == members.numel()  # value-closed
        assert members.numel() >= need_count[r]
    if margin >= 2.0:
        assert bool(ok.all())


def test_threshold_set_misjudged_by_its_subsample_is_flagged_not_short() -> None:
    # The top values sit exactly on the subsample's stride, so the subsample overstates
    # their density 8x and every threshold it proposes holds too few tokens.
    vocab = 16_000
    x = torch.zeros(1, vocab)
    on_stride = torch.arange(0, vocab, SUBSAMPLE_STRIDE)
    x[0, on_stride] = 10.0 + torch.linspace(1.0, 0.0, on_stride.numel())
    need = torch.tensor([800])
    vals, idx, ok = threshold_candidates(x, torch.arange(1), need, 2.0)
    members = int(torch.isfinite(vals[0]).sum())
    assert not bool(ok[0]) or members >= 800, (bool(ok[0]), members)
    assert not bool(ok[0])  # the gathered set fell short: the caller retries wider


def test_settled_ties_give_the_lowest_ids_of_the_row() -> None:
    x = torch.tensor([[0.0, 5.0, 1.0, 1.0, 9.0, 1.0, 1.0, 1.0]])
    rows = torch.tensor([0])
    vals = torch.tensor([[9.0, 5.0, 1.0, 1.0]])
    idx = torch.tensor([[4, 1, 6, 7]])  # a topk that kept the last two of five tied ones
    assert settle_ties(x, rows, vals, idx).tolist() == [[4, 1, 2, 3]]
    none = torch.zeros(0, 4)
    assert settle_ties(x, rows[:0], none, none.long()).shape == (0, 4)
