"""allocate_bitmask / apply_bitmask against a pure-Python reference and xgrammar's own op."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sample.structured.bitmask import allocate_bitmask, apply_bitmask


def _reference(logits: list[list[float]], bitmask: list[list[int]], rows: list[int] | None) -> list[list[float]]:
    """The spec: bit t % 32 of word t // 32 of bitmask row i clear -> logits[rows[i]][t] = -inf."""
    out = [list(r) for r in logits]
    targets = rows if rows is not None else list(range(len(bitmask)))
    for i, target in enumerate(targets):
        for t in range(len(out[target])):
            if not (bitmask[i][t // 32] & 0xFFFFFFFF) >> (t % 32) & 1:
                out[target][t] = -math.inf
    return out


def _random_case(seed: int, n: int, vocab: int, m: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g)
    words = (vocab + 31) // 32
    bits = torch.randint(0, 2, ((m or n), words * 32), generator=g, dtype=torch.int64)
    weights = torch.tensor([1 << b for b in range(32)], dtype=torch.int64)
    packed = (bits.view(-1, words, 32) * weights).sum(-1)
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
    return logits, packed


def test_allocate_is_all_ones() -> None:
    mask = allocate_bitmask(3, 65)
    assert mask.shape == (3, 3) and mask.dtype == torch.int32 and mask.device.type == "cpu"
    assert bool((mask == -1).all())
    with pytest.raises(ConfigError, match="vocab_size"):
        allocate_bitmask(1, 0)
    with pytest.raises(ConfigError, match="num_rows"):
        allocate_bitmask(-1, 5)


@pytest.mark.parametrize("seed, n, vocab", [(0, 1, 1), (1, 3, 31), (2, 4, 32), (3, 5, 33), (4, 7, 100), (5, 2, 259)])
def test_matches_reference(seed: int, n: int, vocab: int) -> None:
    logits, mask = _random_case(seed, n, vocab)
    want = _reference(logits.tolist(), mask.tolist(), None)
    apply_bitmask(logits, mask)
    assert logits.tolist() == want


def test_rows_map_bitmask_rows_to_logits_rows() -> None:
    logits, mask = _random_case(9, 6, 70, m=3)
    rows = torch.tensor([4, 0, 2])
    want = _reference(logits.tolist(), mask.tolist(), rows.tolist())
    apply_bitmask(logits, mask, rows)
    assert logits.tolist() == want
    assert not torch.isinf(logits[[1, 3, 5]]).any()


def test_all_ones_changes_nothing_and_bit_31_counts() -> None:
    logits = torch.randn(2, 64)
    before = logits.clone()
    apply_bitmask(logits, allocate_bitmask(2, 64))
    assert torch.equal(logits, before)
    mask = torch.zeros(2, 2, dtype=torch.int32)
    mask[:, 0] = -(1 << 31)  # bit 31 only: token 31
    apply_bitmask(logits, mask)
    assert torch.isfinite(logits).sum().item() == 2 and torch.isfinite(logits[:, 31]).all()


def test_batch_invariant() -> None:
    logits, mask = _random_case(11, 8, 300)
    alone = logits[5:6].clone()
    apply_bitmask(alone, mask[5:6])
    apply_bitmask(logits, mask)
    assert torch.equal(alone[0], logits[5])


def test_bad_shapes_raise() -> None:
    with pytest.raises(ConfigError, match="covers 32 tokens"):
        apply_bitmask(torch.zeros(1, 33), torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ConfigError, match="int32"):
        apply_bitmask(torch.zeros(1, 3), torch.zeros(1, 1, dtype=torch.int64))
    with pytest.raises(ConfigError, match="rows must be 2"):
        apply_bitmask(torch.zeros(2, 3), torch.zeros(1, 1, dtype=torch.int32))


def test_matches_xgrammar() -> None:
    xgr = pytest.importorskip("xgrammar")
    for seed, n, vocab in [(21, 4, 95), (22, 3, 128), (23, 1, 1000)]:
        logits, mask = _random_case(seed, n, vocab)
        ours = logits.clone()
        apply_bitmask(ours, mask)
        xgr.apply_token_bitmask_inplace(logits, mask)
        assert torch.equal(ours, logits)


@pytest.mark.cuda
def test_on_cuda_the_mask_equals_the_cpu_one_and_reads_nothing_back() -> None:
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(9, 1000, generator=gen)
    bitmask = torch.randint(-(1 << 31), 1 << 31, (4, 32), generator=gen, dtype=torch.int64).to(torch.int32)
    rows = torch.tensor([7, 0, 3, 8])
    want = logits.clone()
    apply_bitmask(want, bitmask, rows)
    got = logits.cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        apply_bitmask(got, bitmask.pin_memory(), rows.pin_memory())  # copied inside, non-blocking
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(got.cpu(), want)
