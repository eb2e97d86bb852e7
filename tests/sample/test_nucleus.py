"""nucleus_draw (the top-p path whose cost does not grow with the nucleus) against
candidate_draw over the whole sorted row (with ``z = row_norm``), for the torch reference
and the Triton kernel."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer_kit.sample import ref_ops
from deepinfer_kit.sample.candidates import sorted_candidates

Case = tuple[torch.Tensor, ...]


def _case(seed: int, rows: int, vocab: int, ties: bool) -> Case:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen) * (0.05 + 4 * torch.rand(rows, 1, generator=gen))
    if ties:
        x = torch.round(x * 2) / 2  # few distinct values: ties at every crossing
    x[torch.rand(rows, vocab, generator=gen) < 0.2] = float("-inf")
    x[1] = float("-inf")  # nothing finite
    x[2, :] = float("-inf")
    x[2, vocab - 1] = 4.0  # only the very last token
    x[3] = 1.0  # all tied
    x[4, : vocab // 2] = -0.0
    x[4, vocab // 2 :] = 0.0  # -0.0 and 0.0 tie
    rows_ = torch.randperm(rows, generator=gen)
    inv_t = (0.3 + 2 * torch.rand(rows, generator=gen)).float()
    p = torch.rand(rows, generator=gen).double().clamp(min=0.02)
    p[0] = 1.0 - 1e-12
    min_p = torch.where(torch.rand(rows, generator=gen) < 0.5, 0.0, 0.3 * torch.rand(rows, generator=gen))
    u = torch.rand(rows, dtype=torch.float64, generator=gen)
    u[0], u[-1] = 0.0, 1.0 - 2.0**-53
    return x, rows_, inv_t, p, min_p, u


def _sorted_draw(case: Case) -> torch.Tensor:
    x, rows, inv_t, p, min_p, u = case
    vals, idx = sorted_candidates(x, rows)
    k = torch.full((rows.shape[0],), x.shape[1])
    z = ref_ops.row_norm(x, rows, inv_t)
    return ref_ops.candidate_draw(vals, idx, inv_t, k, p, min_p, z, u)[0]


def _record_candidate_draws(monkeypatch: pytest.MonkeyPatch, width: int) -> list[torch.Tensor]:
    """Set the Triton nucleus draw's candidate width to ``width`` and record each
    ``candidate_draw``'s ``kept`` counts (the list it returns fills as draws run)."""
    from deepinfer_kit.sample import triton_ops

    calls: list[torch.Tensor] = []
    draw = triton_ops.candidate_draw

    def recording(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tok, kept = draw(*args)
        calls.append(kept)
        return tok, kept

    monkeypatch.setattr(triton_ops, "NUCLEUS_CANDIDATES", width)
    monkeypatch.setattr(triton_ops, "candidate_draw", recording)
    return calls


@pytest.mark.parametrize("vocab", [1, 8, 9, 300, 5000])  # 8, 5000: the 8-byte-word scan
@pytest.mark.parametrize("ties", [False, True])
def test_reference_draws_what_the_full_sort_draws(vocab: int, ties: bool) -> None:
    for seed in range(4):
        case = _case(seed * 31 + vocab, 24, max(vocab, 1), ties)
        assert torch.equal(ref_ops.nucleus_draw(*case), _sorted_draw(case))


def test_wide_nuclei_and_dense_crossings() -> None:
    """Nuclei of thousands of tokens, and a crossing bin holding hundreds of ties."""
    x, rows, inv_t, p, min_p, u = _case(7, 16, 40_000, False)
    x[5:9] *= 0.01  # nearly flat rows: top-p 0.9 keeps ~36k tokens
    x[9, 1000:1600] = 2.5  # 600 tokens tied near the top of a flat row
    x[9, :1000] = 2.6
    case = (x, rows, inv_t, torch.full_like(p, 0.9), min_p * 0, u)
    assert torch.equal(ref_ops.nucleus_draw(*case), _sorted_draw(case))


@pytest.mark.parametrize("consecutive", [False, True])
def test_rows_are_independent_of_their_neighbours(consecutive: bool) -> None:
    """Rows in any order, or consecutive (read as one slab of the logits), draw what
    they draw alone."""
    x, rows, *rest = _case(3, 40, 2000, False)
    case = (x, torch.arange(40) if consecutive else rows, *rest)
    together = ref_ops.nucleus_draw(*case)
    for i in (0, 17, 39):
        alone = ref_ops.nucleus_draw(*(t if t.dim() == 2 else t[i : i + 1] for t in case))
        assert int(alone) == int(together[i])


@pytest.mark.parametrize("slab", [1, 4, 7, 150])
def test_the_slab_size_does_not_change_a_draw(slab: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows drawn 1, 4, 7 or all at a time (``slab_rows`` picks up to 64 for a small
    vocabulary) draw the same tokens."""
    from deepinfer_kit.sample import ref_nucleus

    case = _case(11, 150, 300, False)
    default = ref_ops.nucleus_draw(*case)
    monkeypatch.setattr(ref_nucleus, "slab_rows", lambda vocab: slab)
    assert torch.equal(ref_ops.nucleus_draw(*case), default)
    assert ref_nucleus.slab_rows(300) == slab


def test_slab_rows_shrink_with_the_vocabulary() -> None:
    from deepinfer_kit.sample.ref_nucleus import slab_rows

    assert slab_rows(48) == 64 and slab_rows(152_064) == 4
    assert all(slab_rows(v) >= slab_rows(2 * v) for v in (100, 5_000, 30_000, 100_000))


@pytest.mark.triton
@pytest.mark.parametrize(("vocab", "ties"), [(7, True), (300, False), (700, True)])
def test_triton_kernel_matches_the_reference(vocab: int, ties: bool) -> None:
    from deepinfer_kit.sample import triton_ops

    case = _case(vocab + ties, 10, vocab, ties)
    assert torch.equal(triton_ops.nucleus_draw(*case), ref_ops.nucleus_draw(*case))


@pytest.mark.triton
@pytest.mark.parametrize(("width", "ties"), [(16, False), (16, True), (64, True)])
def test_triton_candidate_path_and_its_fallback_match_the_reference(
    width: int, ties: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows whose nucleus closes inside the ``width`` candidates are settled there, rows
    whose nucleus is wider fall back to the whole-row search; both give the reference's
    tokens (ties at the candidates' last value included)."""
    from deepinfer_kit.sample import triton_ops

    calls = _record_candidate_draws(monkeypatch, width)
    x, rows, inv_t, p, min_p, u = _case(width + ties, 24, 600, ties)
    x[5:12] *= 0.02  # nearly flat rows: nuclei of hundreds of tokens, wider than the set
    x[12:18] *= 8.0  # peaked rows: nuclei of a few tokens
    case = (x, rows, inv_t, p, min_p, u)
    assert torch.equal(triton_ops.nucleus_draw(*case), ref_ops.nucleus_draw(*case))
    kept = calls[0]
    assert bool((kept == -1).any()) and bool((kept > 0).any())  # both paths ran


def _top_p_off_case() -> Case:
    """Rows with ``p == 1`` (top-p off): the nucleus is every token with ``w >= min_p``.

    Row 0 is built so that the row's total as ``row_norm`` sums it (float32 chunk sums)
    falls short of its float64 token-by-token sum: each 1024-token chunk holds one token
    of weight 1 and one of weight ~2^-30, which the float32 chunk sum loses. A cut at
    ``p * z`` (``z = 4``) would close the nucleus at the fourth weight-1 token and never
    reach the small ones; top-p off keeps them, so the draw at ``u -> 1`` is the last
    small token in canonical order (token 3310). Rows 2-5: flat rows, every token kept
    (wider than any candidate set); rows 6-7: min-p leaves a few tokens."""
    gen = torch.Generator().manual_seed(5)
    vocab, rows = 4096, 8
    x = torch.randn(rows, vocab, generator=gen)
    x[0] = float("-inf")
    x[0, [10, 1100, 2200, 3300]] = 0.0
    x[0, [20, 1110, 2210, 3310]] = -30 * math.log(2.0)
    x[1] = float("-inf")  # nothing finite
    x[2:6] *= 0.05
    x[4, ::3] = float("-inf")
    x[5] = 1.0  # all tied
    x[6:8] *= 4.0
    inv_t = torch.ones(rows)
    p = torch.ones(rows, dtype=torch.float64)
    min_p = torch.zeros(rows)
    min_p[6:8] = 0.05
    u = torch.rand(rows, dtype=torch.float64, generator=gen)
    u[0] = u[5] = 1.0 - 2.0**-53
    return x, torch.arange(rows), inv_t, p, min_p, u


def test_top_p_off_draws_over_the_whole_row() -> None:
    """``p == 1``: the reference draws over every token (no cut against differently rounded
    sums), as ``candidate_draw`` over the full sort does."""
    case = _top_p_off_case()
    x, _, _, _, _, _ = case
    assert float(ref_ops.row_norm(x, torch.arange(1), torch.ones(1))) == 4.0  # the small ones lost
    got = ref_ops.nucleus_draw(*case)
    assert int(got[0]) == 3310 and int(got[5]) == x.shape[1] - 1
    assert torch.equal(got, _sorted_draw(case))


@pytest.mark.triton
@pytest.mark.parametrize("width", [4, 8, 1024])
def test_triton_top_p_off_matches_the_reference(width: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``p == 1`` rows through the Triton op: settled among the ``width`` candidates only
    when fewer than ``width`` tokens survive min-p, every other row through the
    whole-row fallback, whose search must then not cut at ``p * z`` either (row 0 at
    widths 4 and 8). Before the fix a ``p == 1`` row was drawn among the
    ``W`` largest logits alone (the GPU mismatch at vocabularies 4096 and 151936)."""
    from deepinfer_kit.sample import triton_ops

    calls = _record_candidate_draws(monkeypatch, width)
    case = _top_p_off_case()
    want = ref_ops.nucleus_draw(*case)
    assert torch.equal(triton_ops.nucleus_draw(*case), want)
    assert int(want[0]) == 3310
    x, _, _, _, min_p, _ = case
    w = torch.exp(x - x.amax(dim=1, keepdim=True).nan_to_num(neginf=0.0))
    survivors = ((w >= min_p.unsqueeze(1)) & (w > 0)).sum(dim=1)
    assert torch.equal(calls[0] == -1, survivors >= width)  # the fallback: W too few
    assert bool((calls[0] == -1).any()) and bool((calls[0] >= 0).any())


@pytest.mark.triton
def test_triton_matches_the_reference_on_the_native_check_s_rows() -> None:
    """The rows of ``test_kernels_native.test_sampler_draws_match_the_reference`` at
    vocabulary 4096 (30% of rows with ``p == 1``), under the interpreter: rows 0, 2 and
    12 differed on the GPU and here alike before the fix."""
    from deepinfer_kit.sample import triton_ops

    vocab, n = 4096, 24
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(n, vocab, generator=gen) * (1 + 3 * torch.rand(n, 1, generator=gen))
    x[torch.rand(n, vocab, generator=gen) < 0.3] = float("-inf")
    x[1] = float("-inf")
    x[3] = 1.0
    rows = torch.randperm(n, generator=gen)
    inv_t = (0.3 + 2 * torch.rand(n, generator=gen)).float()
    min_p = torch.where(torch.rand(n, generator=gen) < 0.5, 0.0, 0.2 * torch.rand(n, generator=gen)).float()
    p = torch.where(torch.rand(n, generator=gen) < 0.3, 1.0, torch.rand(n, generator=gen).double())
    u = torch.rand(n, dtype=torch.float64, generator=gen)
    case = (x, rows, inv_t, p, min_p, u)
    assert int((p == 1.0).sum()) >= 3
    want = ref_ops.nucleus_draw(*case)
    assert torch.equal(triton_ops.nucleus_draw(*case), want)
    assert torch.equal(want, _sorted_draw(case))
