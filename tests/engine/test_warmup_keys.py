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
from deepinfer_kit.engine.runner import warmup
from deepinfer_kit.engine.runner.kernel_keys import launch_key, record_launches
from deepinfer_kit.engine.runner.static_decode import StaticDecode
from deepinfer_kit.models.packing import pack_inputs, unpack_inputs, unpack_tail

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


class _KeyRecorder:
    """Stands in for the attention kernel: records the launch's Triton key (computed from
    the real kernel) and zeroes the output, so the forward runs without the kernel."""

    def __init__(self, kernel: object, seen: set[str]) -> None:
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid: object) -> object:
        def launch(*args: object, **kwargs: object) -> None:
            self.seen.add(launch_key(self.kernel, args, dict(kwargs))[1])
            args[3].zero_()  # type: ignore[attr-defined]

        return launch


@pytest.mark.slow
@pytest.mark.triton
def test_warm_up_covers_the_attention_keys_of_random_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds of every shape the eager path packs — 1 to 6 requests, query lengths 1 to 24
    (decode, verify, chunked prefill), contexts up to ``max_model_len``, 1 to R + 2 logits
    rows — launch only attention keys that warm-up launched, with a GPU-sized split target
    (the key of a launch: its pointers' 16-byte alignment, its integers, its tiles and split
    count). About two minutes on a loaded 2-core CPU; fails with the regions of a packed
    step at 8-byte offsets."""
    from deepinfer_kit.models.attention import splits, triton_ops

    limits = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 2048}
    engine = build_engine(attention_impl="triton", num_blocks=300, block_size=8, **limits)
    runner = engine.runner
    warm: set[str] = set()
    served: set[str] = set()
    monkeypatch.setattr(splits, "split_target", lambda device: 264)
    monkeypatch.setattr(warmup, "split_target", lambda device: 264)
    monkeypatch.setattr(triton_ops, "_paged_attn_kernel",
                        _KeyRecorder(triton_ops._paged_attn_kernel, warm))
    monkeypatch.setattr(triton_ops, "_merge_splits_kernel", _NoKernel())
    monkeypatch.setattr(warmup, "_sample_variants", lambda runner, logits: None)
    warmup.warm_up(runner, capture=False, **limits)
    monkeypatch.setattr(triton_ops, "_paged_attn_kernel",
                        _KeyRecorder(triton_ops._paged_attn_kernel.kernel, served))
    rng = random.Random(3)
    cache = runner.kv_cache
    for _ in range(60):
        r = rng.randint(1, 6)
        query = [rng.choice([1, 1, 2, 3, 5, 8, rng.randint(1, 24)]) for _ in range(r)]
        while sum(query) > limits["max_num_batched_tokens"]:
            query[query.index(max(query))] //= 2
        seq = [q + rng.choice([0, rng.randint(0, 300), rng.randint(0, 2048 - q)]) for q in query]
        tables = [[0] * -(-s // cache.block_size) for s in seq]
        positions = [p for q, s in zip(query, seq) for p in range(s - q, s)]
        rows = sorted(rng.sample(range(sum(query)), rng.randint(1, min(sum(query), r + 2))))
        host, layout = pack_inputs([0] * sum(query), positions, query, seq, tables, rows,
                                   block_size=cache.block_size, pin_memory=False)
        batch = unpack_inputs(host, layout)
        batch.attn.slot_mapping.fill_(cache.pad_slot)
        with torch.inference_mode():
            runner.model(batch, cache)
    missing = served - warm
    assert served and not missing, "\n".join(sorted(missing))


class _NoKernel:
    def __getitem__(self, grid: object) -> object:
        return lambda *args, **kwargs: None
