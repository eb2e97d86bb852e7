"""Warm-up launches every Triton specialisation a serving workload launches: keys computed
with Triton's own binder (pointer alignment, integers equal to 1 or divisible by 16,
constexprs), so a CPU run under the interpreter proves what a GPU would compile."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from deepinfer_kit import build_engine
from deepinfer_kit.engine import warmup
from deepinfer_kit.engine.kernel_keys import launch_key, record_launches
from deepinfer_kit.engine.static_decode import StaticDecode
from deepinfer_kit.engine.step_inputs import pack_inputs, unpack_inputs, unpack_tail

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from differential import run_workload, workload  # noqa: E402

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@triton.jit(do_not_specialize=["stride"])
def _probe_kernel(x_ptr, n, stride, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    tl.store(x_ptr + tl.arange(0, BLOCK), tl.zeros((BLOCK,), dtype=tl.int64))


def test_launch_key_specialises_as_triton_does() -> None:
    buf = torch.zeros(64, dtype=torch.int64)
    assert buf.data_ptr() % 16 == 0

    def key(x: torch.Tensor, n: int, stride: int, block: int = 16) -> str:
        return launch_key(_probe_kernel, (x, n, stride), {"BLOCK": block})[1]

    assert key(buf, 3, 5) == key(buf[2:], 5, 7)  # aligned view, two "other" integers
    assert key(buf, 3, 5) != key(buf[1:], 3, 5)  # 8-byte offset: another variant
    assert len({key(buf, 1, 5), key(buf, 2, 5), key(buf, 32, 5)}) == 3  # n == 1, other, % 16
    assert key(buf, 3, 1) == key(buf, 3, 16)  # do_not_specialize: one variant
    assert key(buf, 3, 5, 16) != key(buf, 3, 5, 32)  # constexprs are part of the key
    assert launch_key(_probe_kernel, (buf, 3, 5), {"BLOCK": 16})[0].endswith("_probe_kernel")


def test_every_region_of_a_packed_step_is_16_byte_aligned() -> None:
    rng = random.Random(7)
    for _ in range(200):
        r = rng.randint(1, 7)
        query = [rng.randint(1, 5) for _ in range(r)]
        seq = [q + rng.randint(0, 20) for q in query]
        tables = [list(range(-(-s // 4))) for s in seq]
        ids = [rng.randrange(100) for _ in range(sum(query))]
        positions = [p for q, s in zip(query, seq) for p in range(s - q, s)]
        rows = sorted(rng.sample(range(sum(query)), rng.randint(1, sum(query))))
        tail = [rng.randrange(9) for _ in range(rng.randint(0, 3))]
        host, layout = pack_inputs(ids, positions, query, seq, tables, rows, block_size=4,
                                   pin_memory=False, tail=tail)
        assert host.data_ptr() % 16 == 0
        batch = unpack_inputs(host, layout)
        attn = batch.attn
        views = [batch.input_ids, batch.positions, attn.slot_mapping, attn.query_start_loc,
                 attn.seq_lens, batch.logits_indices, attn.block_tables, unpack_tail(host, layout)]
        assert [v.data_ptr() % 16 for v in views] == [0] * len(views)
        assert batch.input_ids.tolist() == ids and batch.positions.tolist() == positions
        assert attn.seq_lens.tolist() == seq and batch.logits_indices.tolist() == rows
        assert attn.query_start_loc.tolist()[-1] == sum(query)
        assert unpack_tail(host, layout).tolist() == tail
        assert [t[: len(w)] for t, w in zip(attn.block_tables.tolist(), tables)] == tables


def test_static_decode_buffers_are_aligned_at_every_ladder_size() -> None:
    engine = build_engine(num_blocks=32, block_size=4, max_model_len=64, max_num_seqs=13)
    static = StaticDecode(engine.runner.model, engine.runner.kv_cache, max_num_seqs=13,
                          max_model_len=64)
    for size in static.sizes:
        staged = static.stage([5] * size, [3] * size, [4] * size, [[1]] * size)
        batch, _ = static.load(staged)
        views = [batch.input_ids, batch.positions, batch.attn.slot_mapping, batch.attn.seq_lens,
                 batch.attn.block_tables, batch.attn.query_start_loc]
        assert [v.data_ptr() % 16 for v in views] == [0] * len(views), size
        assert batch.input_ids.tolist() == [5] * size and batch.attn.seq_lens.tolist() == [4] * size


@pytest.mark.slow
@pytest.mark.triton
@pytest.mark.parametrize("seed", [0])
def test_warm_up_covers_every_launch_of_a_serving_workload(seed: int) -> None:
    """The differential workload (greedy, penalties, forks, top-k, top-p with logprobs,
    stop tokens, prefix hits, chunked rounds) on the embedded MoE model with every kernel
    on Triton and the static decode path: each (kernel, key) it launches was launched by
    warm-up first. About two minutes under the interpreter."""
    limits = {"max_num_seqs": 16, "max_num_batched_tokens": 96, "max_model_len": 96}
    engine = build_engine(attention_impl="triton", sampler_impl="triton", moe_impl="triton",
                          static_decode=True, num_blocks=200, block_size=8, **limits)
    with record_launches() as warm:
        warmup.warm_up(engine.runner, capture=False, **limits)
    with record_launches() as served:
        run_workload(workload(seed, 8), engine=engine)
    assert served, "the workload launched no Triton kernel"
    missing = sorted(set(served) - set(warm))
    assert not missing, "compiled after warm-up:\n" + "\n".join(map(str, missing))
