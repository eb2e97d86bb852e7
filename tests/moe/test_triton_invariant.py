"""The MoE Triton experts in batch-invariant mode (``invariant=True``): against the torch
reference, a token's output bitwise the same whoever shares its experts (the interpreter
with a row-alone dot, see ``tests/row_dot.py``; natively on CUDA), and tiles that no
longer follow the batch (the default's ``choose_block_m`` does)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from row_dot import row_invariant_dot  # noqa: F401 (fixture)

from deepinfer_kit.moe import ref_ops

pytestmark = pytest.mark.triton

EXPERTS, HIDDEN, INTER, TOP_K = 6, 40, 24, 4


def _ops() -> Any:
    from deepinfer_kit.moe import triton_ops

    return triton_ops


def _weights(dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5
    return gate_up.to(dtype).to(device), down.to(dtype).to(device)


def _routing(tokens: int, gen: torch.Generator, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=gen), dim=-1)
    return ids.to(device), weights.to(device)


def test_invariant_mode_matches_the_reference() -> None:
    gate_up, down = _weights(torch.float32, "cpu")
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(37, HIDDEN, generator=gen)
    ids, weights = _routing(37, gen, "cpu")
    expected, ref_counts = ref_ops.routed_swiglu(hidden, ids, weights, gate_up, down)
    got, counts = _ops().routed_swiglu(hidden, ids, weights, gate_up, down, invariant=True)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert counts.tolist() == ref_counts.tolist()
    rows = [5, 0, 40, 1, 2, 9]
    x = torch.randn(sum(rows), HIDDEN, generator=gen)
    torch.testing.assert_close(_ops().grouped_swiglu(x, gate_up, down, rows, invariant=True),
                               ref_ops.grouped_swiglu(x, gate_up, down, rows), rtol=1e-4, atol=1e-5)


def _same_token_in_any_company(dtype: torch.dtype, device: str) -> None:
    """Token ``v`` with its routing alone, and among 1, 5 and 150 tokens routed (partly
    or all) to the same experts, at the first, a middle and the last place: the same bits.
    150 tokens x 4 copies over 6 experts is past the default's 16-row tile threshold."""
    gate_up, down = _weights(dtype, device)
    gen = torch.Generator().manual_seed(3)
    v = torch.randn(1, HIDDEN, generator=gen).to(dtype).to(device)
    v_ids, v_w = _routing(1, gen, device)
    alone, _ = _ops().routed_swiglu(v, v_ids, v_w, gate_up, down, invariant=True)
    for others in (1, 5, 150):
        hidden = torch.randn(others + 1, HIDDEN, generator=gen).to(dtype).to(device)
        ids, weights = _routing(others + 1, gen, device)
        if others == 150:
            ids[:] = v_ids  # every copy on the token's own experts
        for place in sorted({0, others // 2, others}):
            h, i, w = hidden.clone(), ids.clone(), weights.clone()
            h[place], i[place], w[place] = v[0], v_ids[0], v_w[0]
            got, _ = _ops().routed_swiglu(h, i, w, gate_up, down, invariant=True)
            assert torch.equal(got[place], alone[0]), (others, place)


def _same_row_in_any_group(dtype: torch.dtype, device: str) -> None:
    """A row of expert 2 alone, and first or last of 1, 20 or 90 rows of it (others on
    other experts): the same bits."""
    gate_up, down = _weights(dtype, device)
    gen = torch.Generator().manual_seed(4)
    v = torch.randn(1, HIDDEN, generator=gen).to(dtype).to(device)
    counts = [0] * EXPERTS
    counts[2] = 1
    alone = _ops().grouped_swiglu(v, gate_up, down, counts, invariant=True)
    for mine in (2, 21, 90):
        counts = [3, 0, mine, 7, 0, 50]
        x = torch.randn(sum(counts), HIDDEN, generator=gen).to(dtype).to(device)
        for place in (3, 3 + mine - 1):
            x[place] = v[0]
            got = _ops().grouped_swiglu(x, gate_up, down, counts, invariant=True)
            assert torch.equal(got[place], alone[0]), (mine, place)


@pytest.mark.usefixtures("row_invariant_dot")
def test_a_token_is_bitwise_the_same_whoever_shares_its_experts() -> None:
    _same_token_in_any_company(torch.float32, "cpu")


@pytest.mark.usefixtures("row_invariant_dot")
def test_a_grouped_row_is_bitwise_the_same_however_many_share_its_expert() -> None:
    _same_row_in_any_group(torch.float32, "cpu")


def test_invariant_tiles_do_not_follow_the_batch() -> None:
    """The default picks a 16- or 32-row tile from the copy counts; invariant mode keeps one."""
    ops = _ops()
    assert ops.choose_block_m(4, EXPERTS) != ops.choose_block_m(600, EXPERTS)
    gate_up, down = _weights(torch.float32, "cpu")
    seen: set[int] = set()
    original = ops.align_block_size

    def spy(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> Any:
        seen.add(block_m)
        return original(expert_ids, num_experts, block_m)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ops, "align_block_size", spy)
        gen = torch.Generator().manual_seed(5)
        for tokens in (1, 150):
            ids, weights = _routing(tokens, gen, "cpu")
            ops.routed_swiglu(torch.zeros(tokens, HIDDEN), ids, weights, gate_up, down, invariant=True)
            ops.grouped_swiglu(torch.zeros(tokens * 4, HIDDEN), gate_up, down,
                               [tokens * 4, 0, 0, 0, 0, 0], invariant=True)
    assert seen == {ops.INVARIANT_BLOCK_M}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_is_bitwise_the_same_whoever_shares_its_experts_on_cuda(dtype: torch.dtype) -> None:
    _same_token_in_any_company(dtype, "cuda")
    _same_row_in_any_group(dtype, "cuda")
