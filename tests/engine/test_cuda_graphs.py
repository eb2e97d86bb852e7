"""On a GPU: captured decode equals eager decode token for token (dense and MoE, fp32 and
bf16, and a real-shape bf16 head_dim-128 model), no Triton compilation after warm-up
(counted by ``engine.kernel_keys.compiled_variants``), the graphs share one logits buffer,
a second engine sizes its KV pool in the same process, no host synchronisation inside a
captured round, traced captured rounds count what eager ones count, captured EPLB rounds
across rebalances equal eager ones. Skipped without CUDA."""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer_kit import SamplingParams, build_engine
from deepinfer_kit.engine.runner.kernel_keys import compiled_keys, compiled_variants
from differential import run_workload, workload

pytestmark = pytest.mark.cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

CONFIG = {"device": "cuda", "num_blocks": 200, "block_size": 8, "max_model_len": 96,
          "max_num_seqs": 16, "max_num_batched_tokens": 96}


def _model(kind: str, tmp_path: Path) -> str:
    if kind == "tiny":
        return "tiny"  # the embedded Qwen3-MoE-style model
    from hf_models import make_checkpoint

    make_checkpoint("qwen3", tmp_path)
    return str(tmp_path)


def _vocab(kind: str) -> int:
    """The prompt ids' bound for ``workload``: the tiny model's 250, the test checkpoint's 160."""
    return 250 if kind == "tiny" else 160


def _jit_kernels() -> list[Any]:
    from triton.runtime.jit import JITFunction

    found: dict[int, Any] = {}  # each kernel once, whichever modules import it
    for name, module in list(sys.modules.items()):
        if name.startswith("deepinfer_kit") and module is not None:
            found.update((id(v), v) for v in vars(module).values() if isinstance(v, JITFunction))
    return list(found.values())


def _compiled(kernels: list[Any]) -> int:
    """Compiled variants held by the kernels' caches (any Triton 3.x layout)."""
    total = 0
    for fn in kernels:
        caches = getattr(fn, "device_caches", None)
        if caches is not None:
            total += sum(len(entry[0]) for entry in caches.values())
        else:
            total += sum(len(c) for c in getattr(fn, "cache", {}).values())
    return total


def _compiled_since(before: dict[str, set[str]]) -> str:
    """The kernels that gained compiled variants since ``before`` (a ``compiled_keys()``),
    one line per new key (Triton's cache key, as ``kernel_keys.launch_key`` and
    scripts/count_warmup_variants.py --workload print it); empty when none did."""
    return "\n".join(f"{name}: {key}" for name, keys in sorted(compiled_keys().items())
                     for key in sorted(keys - before.get(name, set())))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["tiny", "dense"])
def test_captured_decode_equals_eager_decode(kind: str, dtype: str, tmp_path: Path) -> None:
    model = _model(kind, tmp_path)
    reqs = workload(0, 24, _vocab(kind))
    want, eager = run_workload(reqs, model=model, dtype=dtype, cuda_graphs=False,
                               static_decode=True, **CONFIG)
    got, engine = run_workload(reqs, model=model, dtype=dtype, **CONFIG)
    static = engine.runner.static
    assert static is not None
    assert static.captured_sizes == static.sizes
    assert eager.runner.static is not None and not eager.runner.static.captured_sizes
    assert got == want


def test_traced_captured_rounds_count_what_eager_rounds_count() -> None:
    """A traced engine replays captured decode rounds, and each step's routed counts (real
    rows only, read from the layers' count tensors that every replay rewrites) equal the
    eager engine's, step for step."""
    reqs = workload(3, 11)
    traces: dict[str, list[Any]] = {"eager": [], "captured": []}
    eager = build_engine(cuda_graphs=False, static_decode=False, **CONFIG, trace=traces["eager"].append)
    want, _ = run_workload(reqs, engine=eager)
    engine = build_engine(**CONFIG, trace=traces["captured"].append)
    assert engine.runner.static is not None and engine.runner.static.captured_sizes
    got, _ = run_workload(reqs, engine=engine)
    assert got == want
    counts = [(t.step_id, t.expert_counts) for t in traces["captured"]]
    assert counts == [(t.step_id, t.expert_counts) for t in traces["eager"]]


@pytest.mark.parametrize("dispatch", ["static", "balanced"])
def test_captured_eplb_rounds_equal_eager_ones_across_rebalances(dispatch: str) -> None:
    """EPLB with captured decode rounds: a rebalance rewrites the slot maps and selector
    tables in place, so the graphs keep serving; tokens, windows and plans equal the
    eager EPLB engine's."""
    eplb = {"window": 3, "interval": 2, "num_redundant": 4, "num_gpus": 4, "dispatch": dispatch}
    reqs = workload(4, 12)
    want, eager = run_workload(reqs, eplb=eplb, cuda_graphs=False, static_decode=False, **CONFIG)
    got, engine = run_workload(reqs, eplb=eplb, **CONFIG)
    static = engine.runner.static
    assert static is not None and static.captured_sizes
    assert got == want
    here, there = eager.balancer, engine.balancer
    assert here is not None and there is not None and len(there.history) >= 2
    assert [r.after_step for r in there.history] == [r.after_step for r in here.history]
    for a, b in zip(here.history, there.history):
        assert torch.equal(a.window.cpu(), b.window.cpu()) and torch.equal(a.phy2log, b.phy2log)


@pytest.mark.parametrize("kind", ["tiny", "dense"])
def test_no_triton_compilation_after_warm_up(kind: str, tmp_path: Path) -> None:
    engine = build_engine(model=_model(kind, tmp_path), dtype="bfloat16", **CONFIG)
    kernels = _jit_kernels()
    assert kernels, "no Triton kernel was loaded: the engine is not on the Triton path"
    before = compiled_variants()
    assert before == _compiled(kernels) > 0
    keys = compiled_keys()
    run_workload(workload(1, 24, _vocab(kind)), engine=engine)
    assert compiled_variants() - before == 0, "compiled after warm-up:\n" + _compiled_since(keys)


def test_a_real_shape_bf16_head_dim_128_model_captures_and_matches_eager(tmp_path: Path) -> None:
    """Qwen3-1.7B's layer shape (hidden 2048, 16 / 8 heads of 128, intermediate 6144, vocab
    151936), two layers, random bf16 weights: prefill tiles of 64 x 64 at head_dim 128
    compile and load, capture works, and captured == eager token for token."""
    from bench_decode import FULL_SHAPE, build_checkpoint

    shape = (FULL_SHAPE[0], 2, *FULL_SHAPE[2:])
    build_checkpoint(tmp_path, shape, torch.bfloat16, torch.device("cuda"), seed=0)
    config = {**CONFIG, "num_blocks": 400, "max_model_len": 256, "max_num_batched_tokens": 256}
    reqs = [(f"r{i}", [(7 * i + j) % 150000 + 1 for j in range(20 + 9 * i)],
             SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)) for i in range(6)]
    want, _ = run_workload(reqs, model=str(tmp_path), dtype="bfloat16", cuda_graphs=False,
                           static_decode=True, **config)
    engine = build_engine(model=str(tmp_path), dtype="bfloat16", **config)
    static = engine.runner.static
    assert static is not None and static.captured_sizes
    before = compiled_keys()
    got, _ = run_workload(reqs, engine=engine)
    assert got == want
    assert not _compiled_since(before), "compiled after warm-up:\n" + _compiled_since(before)


def test_graphs_share_one_logits_buffer_and_a_second_engine_sizes_its_pool() -> None:
    sized = {"device": "cuda", "max_num_seqs": 16, "max_model_len": 96,
             "gpu_memory_utilization": 0.3}  # other xdist workers share the GPU
    first = build_engine(**sized)
    static = first.runner.static
    assert static is not None and len(static.captured_sizes) > 1
    outs = {size: static.forward(static._padded_batch(size, static.max_model_len), size)
            for size in static.sizes}
    base = outs[static.sizes[-1]].data_ptr()
    assert all(out.data_ptr() == base for out in outs.values())
    del first, static, outs
    gc.collect()
    second = build_engine(**sized)  # sized after empty_cache: the first pool is free again
    run_workload(workload(2, 8), engine=second)


def test_a_captured_round_never_synchronises_the_host() -> None:
    engine = build_engine(**CONFIG)
    static = engine.runner.static
    assert static is not None and static.captured_sizes
    load, forward = static.load, static.forward
    rounds: list[int] = []

    def strict_load(staged: Any) -> Any:
        torch.cuda.set_sync_debug_mode("error")
        try:
            return load(staged)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def strict_forward(batch: Any, size: int) -> torch.Tensor:
        torch.cuda.set_sync_debug_mode("error")
        try:
            rounds.append(size)
            return forward(batch, size)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    static.load = strict_load  # type: ignore[method-assign]
    static.forward = strict_forward  # type: ignore[method-assign]
    for i in range(5):
        engine.add_request(f"r{i}", [1, 2, 3, 4 + i], SamplingParams(temperature=0.0, max_tokens=8))
    engine.run()
    engine.check_idle()
    assert rounds


def test_a_pipelined_launch_never_synchronises_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU twin of tests/engine/test_launch_reads_nothing_back.py: every launch that
    may pipeline runs under ``sync_debug_mode("error")`` — top-k, top-p, min-p, logprobs
    and greedy rows on the captured path of an overlapped EPLB engine whose rounds are
    traced, across rebalances."""
    from deepinfer_kit.engine.runner.model_runner import ModelRunner

    launch = ModelRunner.launch
    strict: list[int] = []

    def checked(self: ModelRunner, step: Any) -> Any:
        if not self.pipelines(step):
            return launch(self, step)
        torch.cuda.set_sync_debug_mode("error")
        try:
            strict.append(1)
            return launch(self, step)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(ModelRunner, "launch", checked)
    eplb = {"window": 3, "interval": 2, "num_redundant": 4, "num_gpus": 4, "dispatch": "balanced"}
    engine = build_engine(overlap=True, eplb=eplb, **CONFIG, trace=lambda trace: None)
    kinds = [SamplingParams(temperature=0.0, max_tokens=8),
             SamplingParams(temperature=0.8, top_k=20, seed=1, max_tokens=8),
             SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05, seed=2, max_tokens=8),
             SamplingParams(temperature=1.0, top_k=50, top_p=0.9, logprobs=3, seed=3, max_tokens=8)]
    for i in range(8):
        engine.add_request(f"r{i}", [1, 2, 3, 4 + i], kinds[i % len(kinds)])
    outs = engine.run()
    engine.check_idle()
    assert len(outs) == 8 and strict
    assert engine.balancer is not None and engine.balancer.history



def test_captured_decode_per_context_bucket_equals_eager_at_short_and_long_contexts() -> None:
    """With a long ``max_model_len`` a batch of one gets a graph per context bucket (its
    split count follows its context, not ``max_model_len``); captured rounds at short and
    long contexts equal eager ones, and nothing compiles after warm-up."""
    config = {**CONFIG, "num_blocks": 1200, "max_model_len": 4096, "max_num_batched_tokens": 4096,
              "max_num_seqs": 4}
    reqs = [(f"r{i}", [(11 * i + j) % 250 + 3 for j in range(n)],
             SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
            for i, n in enumerate((6, 200, 700, 1500, 3000))]
    want, _ = run_workload(reqs, cuda_graphs=False, static_decode=True, **config)
    engine = build_engine(**config)
    static = engine.runner.static
    assert static is not None and len(static.buckets[1]) > 2
    assert static.captured_graphs == sorted((s, b) for s, bounds in static.buckets.items() for b in bounds)
    replayed: list[tuple[int, int]] = []
    forward = static.forward

    def recording(batch: Any, size: int) -> Any:
        replayed.append(static.graph_key(size, batch.attn.max_seq_len))
        return forward(batch, size)

    static.forward = recording  # type: ignore[method-assign]
    before = compiled_keys()
    for rid, prompt, params in reqs:  # one at a time: batch-of-one rounds at each length
        got, _ = run_workload([(rid, prompt, params)], engine=engine)
        assert got[rid] == want[rid]
    assert not _compiled_since(before), "compiled after warm-up:\n" + _compiled_since(before)
    assert len({b for s, b in replayed if s == 1}) >= 3  # short and long buckets both replayed
