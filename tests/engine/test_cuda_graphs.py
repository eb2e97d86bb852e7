"""On a GPU: captured decode equals eager decode token for token, no Triton compilation
after warm-up, no host synchronisation inside a captured round. Skipped without CUDA."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer_kit import SamplingParams, build_engine
from differential import run_workload, workload

pytestmark = pytest.mark.cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

CONFIG = {"device": "cuda", "num_blocks": 200, "block_size": 8, "max_model_len": 96,
          "max_num_seqs": 16, "max_num_batched_tokens": 96}


def _model(kind: str, tmp_path: Path) -> str:
    if kind == "tiny":
        return "tiny"  # the embedded Qwen3-MoE-style model
    from hf_models import make_checkpoint

    make_checkpoint("qwen3", tmp_path)
    return str(tmp_path)


def _jit_kernels() -> list[Any]:
    from triton.runtime.jit import JITFunction

    found = []
    for name, module in list(sys.modules.items()):
        if name.startswith("deepinfer_kit") and module is not None:
            found += [v for v in vars(module).values() if isinstance(v, JITFunction)]
    return found


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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["tiny", "dense"])
def test_captured_decode_equals_eager_decode(kind: str, dtype: str, tmp_path: Path) -> None:
    model = _model(kind, tmp_path)
    reqs = workload(0, 24)
    want, eager = run_workload(reqs, model=model, dtype=dtype, cuda_graphs=False,
                               static_decode=True, **CONFIG)
    got, engine = run_workload(reqs, model=model, dtype=dtype, **CONFIG)
    static = engine.runner.static
    assert static is not None and static.capture_error is None
    assert static.captured_sizes == static.sizes
    assert eager.runner.static is not None and not eager.runner.static.captured_sizes
    assert got == want


def test_no_triton_compilation_after_warm_up() -> None:
    engine = build_engine(**CONFIG)
    kernels = _jit_kernels()
    assert kernels, "no Triton kernel was loaded: the engine is not on the Triton path"
    before = _compiled(kernels)
    run_workload(workload(1, 24), engine=engine)
    assert _compiled(_jit_kernels()) == before


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
