"""The batch-invariant Triton paged attention (``triton_ops.paged_attention_invariant``):
against the torch reference (the interpreter on CPU), the split path bitwise equal to the
in-program one, a row bitwise the same in any batch and any chunking (the interpreter with
a row-alone dot, see ``tests/row_dot.py``; natively on CUDA), one launch configuration for
every batch, the split helpers warm-up relies on, and a compile for sm_90."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import attrs
import pytest
import torch
from kernel_compile import LaunchCapture, assert_kernels_compile
from paged_cases import HEAD_LAYOUTS, dense_attention, make_case, random_lengths
from row_dot import row_invariant_dot  # noqa: F401 (fixture)

from deepinfer_kit.models.attention import PagedAttention, make_attention_metadata, ref_ops, splits

pytestmark = pytest.mark.triton

SPLIT = splits.INVARIANT_SPLIT_KEYS


def _ops() -> Any:
    from deepinfer_kit.models.attention import triton_ops

    return triton_ops


def _invariant(case, split_programs=None, meta=None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return _ops().paged_attention_invariant(case.query, case.key_cache, case.value_cache,
                                            meta or case.meta, case.scale, None,
                                            split_programs=split_programs)


def _ref(case) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return ref_ops.paged_attention(case.query, case.key_cache, case.value_cache, case.meta, case.scale)


@pytest.mark.parametrize("seed", range(3))
def test_random_layouts_match_reference(seed: int) -> None:
    rng = random.Random(200 + seed)
    hq, hkv = rng.choice(HEAD_LAYOUTS)
    lengths = random_lengths(rng, rng.randint(1, 3), max_ctx=40) + [(1, rng.randint(SPLIT, SPLIT + 60))]
    case = make_case(lengths, block_size=rng.choice([4, 16]), num_heads=hq, num_kv_heads=hkv, seed=seed)
    expected = _ref(case)
    for split_programs in (False, True):
        torch.testing.assert_close(_invariant(case, split_programs), expected, atol=1e-5, rtol=1e-5)


def test_split_programs_give_the_bits_of_the_in_program_merge() -> None:
    case = make_case([(1, 2 * SPLIT + 9), (3, SPLIT + 1), (20, 40), (1, 5)], block_size=16,
                     num_heads=6, num_kv_heads=2, seed=9)
    merged_in_program = _invariant(case, split_programs=False)
    assert torch.equal(_invariant(case, split_programs=True), merged_in_program)
    assert torch.equal(_invariant(case), merged_in_program)  # the default choice


@pytest.mark.parametrize("head_dim", [24, 8])
def test_head_dim_not_a_power_of_two_or_below_16(head_dim: int) -> None:
    case = make_case([(1, 37), (12, 12), (3, SPLIT + 3)], block_size=8, num_heads=6, num_kv_heads=3,
                     head_dim=head_dim, seed=head_dim)
    torch.testing.assert_close(_invariant(case, True), _ref(case), atol=1e-5, rtol=1e-5)


def test_host_max_seq_len_too_large_changes_no_bit_and_too_small_stays_correct() -> None:
    """A replayed CUDA graph's host bound is larger than the batch's longest context: more
    split programs, all empty for these rows. An understated one (misuse) stays correct."""
    case = make_case([(1, SPLIT + 40), (2, 30)], block_size=16, num_heads=4, num_kv_heads=2, seed=2)
    exact = _invariant(case, True)
    larger = attrs.evolve(case.meta, max_seq_len=3 * SPLIT + 1)
    assert torch.equal(_invariant(case, True, larger), exact)
    smaller = attrs.evolve(case.meta, max_seq_len=10)
    torch.testing.assert_close(_invariant(case, True, smaller), _ref(case), atol=1e-5, rtol=1e-5)


def test_requests_with_no_query_tokens_and_empty_batches() -> None:
    """Padded requests (query length 0, as a static decode round holds them) write nothing."""
    case = make_case([(1, SPLIT + 9), (5, 21)], block_size=16, num_heads=4, num_kv_heads=2, seed=3)
    meta = case.meta
    qlens, slens = [0, 1, 0, 5], [20, SPLIT + 9, 0, 21]
    tables = meta.block_tables.tolist()
    tables = [[0] * len(tables[0]), tables[0], [0] * len(tables[0]), tables[1]]
    padded = attrs.evolve(
        meta, block_tables=torch.tensor(tables, dtype=torch.int32),
        query_start_loc=torch.tensor([0, 0, 1, 1, 6], dtype=torch.int32),
        seq_lens=torch.tensor(slens, dtype=torch.int32), max_seq_len=max(slens),
        query_lens_host=qlens, seq_lens_host=slens,
    )  # fmt: skip
    for split_programs in (False, True):
        got = _invariant(case, split_programs, padded)
        torch.testing.assert_close(got.double(), dense_attention(case), atol=1e-5, rtol=1e-5)
    empty = dataclasses.replace(case, query=case.query[:0])
    assert _invariant(empty, True).shape == (0, 4, 16)


def test_backend_runs_it_when_batch_invariant_on_the_triton_path() -> None:
    case = make_case([(1, 70), (6, 6)], block_size=16, num_heads=4, num_kv_heads=2, seed=4)
    attn = PagedAttention(4, 2, 16, case.scale, impl="triton", batch_invariant=True)
    assert attn.impl == "triton"
    got = attn(case.query, case.key_cache, case.value_cache, case.meta)
    assert torch.equal(got, _invariant(case))


class _Pool:
    """A KV pool holding a target context in shuffled blocks and room for others, with the
    target's query vectors at every position: batches over it run the same rows in other
    company and other chunkings."""

    def __init__(self, target_len: int, *, block: int = 8, hq: int = 4, hkv: int = 2, d: int = 16,
                 dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        gen = torch.Generator().manual_seed(5)
        self.block, self.hq, self.d, self.dtype, self.device = block, hq, d, dtype, device
        self.free = torch.randperm(400, generator=gen).tolist()
        self.keys = torch.randn(400, block, hkv, d, generator=gen).to(dtype).to(device)
        self.values = torch.randn(400, block, hkv, d, generator=gen).to(dtype).to(device)
        self.target = self.take(target_len)
        self.target_q = torch.randn(target_len, hq, d, generator=gen).to(dtype).to(device)
        self.gen = gen

    def take(self, length: int) -> list[int]:
        n = -(-length // self.block)
        blocks, self.free = self.free[:n], self.free[n:]
        return blocks

    def run(self, rows: tuple[int, int], others: list[tuple[int, int]], split_programs: bool | None = None,
            ) -> torch.Tensor:
        """The target's output rows for positions ``[lo, hi)`` (its context ``hi``), among
        ``others`` ``(query_len, seq_len)`` placed before and after it."""
        lo, hi = rows
        half = len(others) // 2
        lens = others[:half] + [(hi - lo, hi)] + others[half:]
        tables = [self.take(s) for _, s in others[:half]] + [self.target] + \
                 [self.take(s) for _, s in others[half:]]
        meta = make_attention_metadata([q for q, _ in lens], [s for _, s in lens], tables, self.block,
                                       torch.device(self.device))
        parts = [torch.randn(q, self.hq, self.d, generator=self.gen).to(self.dtype).to(self.device)
                 for q, _ in others]
        query = torch.cat(parts[:half] + [self.target_q[lo:hi]] + parts[half:])
        out = _ops().paged_attention_invariant(query, self.keys, self.values, meta, self.d ** -0.5,
                                               split_programs=split_programs)
        start = sum(q for q, _ in others[:half])
        self.free += [b for t in tables if t is not self.target for b in t]
        return out[start:start + hi - lo]


def _same_row_in_any_batch(pool: _Pool, n: int, trials: int) -> None:
    """The target's last row (a decode row alone) against the same row in other batches
    and chunkings, merged in program or across programs; and an earlier row as a verify
    row and as a decode row at its own context."""
    last = pool.run((n - 1, n), [])[0]
    rng = random.Random(0)
    for trial in range(trials):
        others = [rng.choice([1, 1, 5, 30]) for _ in range(rng.randint(0, 3))]
        others = [(q, q + rng.randint(0, 2 * SPLIT)) for q in others]
        lo = rng.choice([n - 1, n - 5, n - 17, n - 70])  # decode, verify, prefill chunks
        split_programs = [None, False, True][trial % 3]
        assert torch.equal(pool.run((lo, n), others, split_programs)[-1], last), (lo, others)
    mid = SPLIT + 3
    assert torch.equal(pool.run((mid - 3, n), [(1, 2 * SPLIT)], True)[2], pool.run((mid - 1, mid), [])[0])
    assert torch.equal(pool.run((mid - 40, mid), [(7, 70)])[-1], pool.run((mid - 1, mid), [(1, 9)], True)[0])


@pytest.mark.usefixtures("row_invariant_dot")
def test_a_row_is_bitwise_the_same_in_any_batch_and_any_chunking() -> None:
    _same_row_in_any_batch(_Pool(SPLIT + 37), SPLIT + 37, trials=4)


@pytest.mark.usefixtures("row_invariant_dot")
@pytest.mark.parametrize("lo", [0, 2, 5, 10])
def test_a_row_among_query_rows_of_its_own_request(lo: int) -> None:
    """Row 40 of a request computed in chunks starting at ``lo``: the same bits (a tile
    then holds other positions of the same request)."""
    pool = _Pool(48, hq=6, hkv=2)
    alone = pool.run((40, 41), [])[0]
    assert torch.equal(pool.run((lo, 48), [(3, 200)])[40 - lo], alone)


@pytest.mark.usefixtures("row_invariant_dot")
@pytest.mark.parametrize("pos", [31, SPLIT - 1])
def test_a_row_whose_tile_reads_past_its_key_step_and_split(pos: int) -> None:
    """A row first in its query tile, at the last key of a key step (31) or of a split
    (255): the tile reads a whole step, or a whole split, the row cannot see; its state
    must come out of them bitwise unchanged."""
    _early_row_in_its_tile(_Pool(SPLIT + 40, hq=2, hkv=2), pos)  # one row per token: 16 per tile


def _early_row_in_its_tile(pool: _Pool, pos: int) -> None:
    """Row ``pos`` alone against the same row first (and 17th) in a prefill chunk's tile."""
    alone = pool.run((pos, pos + 1), [])[0]
    for lo in (pos, pos - 16):
        for split_programs in (False, True):
            assert torch.equal(pool.run((lo, pos + 40), [(1, 3)], split_programs)[pos - lo], alone)


def test_one_tile_configuration_for_every_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode, verify and prefill batches, short and long contexts, split or not: the
    kernel's constexprs (tiles, split size) never change."""
    from deepinfer_kit.models.attention import triton_invariant

    capture = LaunchCapture()
    monkeypatch.setattr(triton_invariant, "_invariant_attn_kernel", capture)
    monkeypatch.setattr(triton_invariant, "_invariant_merge_kernel", LaunchCapture())
    for lengths in ([(1, 5)], [(1, 900)] * 3, [(5, 300), (5, 40)], [(64, 64)], [(200, 900), (1, 3)]):
        case = make_case(lengths, block_size=16, num_heads=8, num_kv_heads=2, seed=0)
        for split_programs in (False, True):
            _invariant(case, split_programs)
    assert len({tuple(sorted(kwargs.items())) for _, kwargs in capture.launches}) == 1


def test_split_helpers() -> None:
    assert [splits.invariant_num_splits(n) for n in (0, 1, SPLIT, SPLIT + 1, 5 * SPLIT)] == [1, 1, 1, 2, 5]
    for args in ((1, 2, 1024, 2, 264), (1, 200, 1024, 2, 264), (9, 2, 4096, 2, 264), (1, 1, 300, 1, 264)):
        assert splits.invariant_split_programs(*args) == (splits.num_splits_for(*args) > 1)


@pytest.mark.parametrize(("max_requests", "max_model_len", "kv_heads"),
                         [(1, 600, 1), (256, 32768, 8), (64, 511, 2)])
def test_warm_up_witnesses_reach_the_split_path_whenever_a_round_can(
    max_requests: int, max_model_len: int, kv_heads: int,
) -> None:
    """Warm-up runs one decode round per ``num_splits_witnesses`` entry: one of them takes
    the invariant kernel's split path (so its merge kernel compiles) exactly when some
    round of the engine can."""
    target = 264
    witnesses = splits.num_splits_witnesses(max_requests, max_model_len, kv_heads, target)
    warmed = any(splits.invariant_split_programs(1, r, s, kv_heads, target) for r, s in witnesses.values())
    possible = any(splits.invariant_split_programs(1, r, s, kv_heads, target)
                   for r in range(1, max_requests + 1) for s in (max_model_len,))
    assert warmed == possible


@pytest.mark.parametrize(("name", "precision"), [
    ("bf16", None), pytest.param("fp32", "ieee", marks=pytest.mark.slow)])
def test_kernels_compile_for_a_cuda_target(name: str, precision: str | None) -> None:
    """Both kernels compile for sm_90 (see tests/kernel_compile.py)."""
    attn = ("q_ptr:*{t} k_ptr:*{t} v_ptr:*{t} out_ptr:*{t} part_out_ptr:*fp32 part_ml_ptr:*fp32 "
            "tables_ptr:*i32 qstart_ptr:*i32 seqlen_ptr:*i32 sm_scale:fp32 q_st:i32 q_sh:i32 k_sb:i32 "
            "k_sp:i32 k_sh:i32 v_sb:i32 v_sp:i32 v_sh:i32 o_st:i32 o_sh:i32 table_stride:i32 "
            "num_m_tiles:i32 grid_splits:i32")
    merge = "part_out_ptr:*fp32 part_ml_ptr:*fp32 out_ptr:*{t} o_st:i32 o_sh:i32 num_splits:i32"
    assert_kernels_compile(
        "deepinfer_kit.models.attention.triton_invariant",
        {"_invariant_attn_kernel": attn.format(t=name), "_invariant_merge_kernel": merge.format(t=name)},
        {"_invariant_attn_kernel": {"NUM_HQ": 16, "GROUPS": 2, "HEAD_DIM": 128, "PAGE": 16,
                                    "SPLIT_KEYS": SPLIT, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_D": 128,
                                    "PRECISION": precision},  # type: ignore[dict-item]
         "_invariant_merge_kernel": {"NUM_HQ": 16, "HEAD_DIM": 128, "BLOCK_D": 128}},
        ("k_sh", "v_sh", "o_sh"),
    )


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_bitwise_the_same_in_any_batch_on_cuda(dtype: torch.dtype) -> None:
    n = 3 * SPLIT + 37
    _same_row_in_any_batch(_Pool(n, block=16, hq=16, hkv=4, d=128, dtype=dtype, device="cuda"), n, trials=24)
    for pos in (63, SPLIT - 1, 2 * SPLIT - 1):  # the ends of a 64-key step and of splits
        _early_row_in_its_tile(_Pool(n, block=16, hq=4, hkv=4, d=128, dtype=dtype, device="cuda"), pos)


@pytest.mark.cuda
@pytest.mark.parametrize("seed", range(3))
def test_bf16_on_cuda_matches_reference(seed: int) -> None:
    rng = random.Random(seed)
    hq, hkv = rng.choice(HEAD_LAYOUTS)
    case = make_case(random_lengths(rng, 8, max_ctx=900), block_size=16, num_heads=hq, num_kv_heads=hkv,
                     head_dim=64, dtype=torch.bfloat16, device="cuda", seed=seed)
    for split_programs in (False, True):
        torch.testing.assert_close(_invariant(case, split_programs).float(), _ref(case).float(),
                                   atol=2e-2, rtol=2e-2)
