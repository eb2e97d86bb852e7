"""The paged-attention tiles a GPU launches at a real head_dim-128 shape (Qwen3-1.7B: 16
query / 8 KV heads) fit an H100/H200's shared memory: each launch is compiled for sm_90
by Triton's own CUDA backend on the CPU and its reported shared memory compared with the
227 KiB a program may use there. Slow (Triton compiles each tile config, fp32 ~1 min).

The compile runs in a subprocess without ``TRITON_INTERPRET``: the interpreter replaces
``triton.language``'s helpers, which the compiler then cannot compile."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from kernel_compile import LaunchCapture

from deepinfer_kit.engine.runner.kernel_keys import shared_memory_bytes
from deepinfer_kit.models.packing import last_token_batch

pytest.importorskip("triton.backends.nvidia.compiler")

pytestmark = [pytest.mark.slow, pytest.mark.triton]

SM90_MAX_SHARED = 227 * 1024  # per thread block, opt-in, on compute capability 9.0
HQ, HKV, HEAD_DIM, PAGE = 16, 8, 128, 16


def _gpu_launch(dtype: torch.dtype, query_lens: list[int],
                seq_lens: list[int]) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """The attention kernel's launch as ``paged_attention`` makes it on a CUDA device
    (this process only: it patches the module)."""
    from deepinfer_kit.models.attention import triton_ops

    kernel, capture, tiles = triton_ops._paged_attn_kernel, LaunchCapture(), triton_ops.tile_config
    triton_ops._paged_attn_kernel = capture  # type: ignore[assignment]
    triton_ops.tile_config = lambda q, g, d, on_cuda: tiles(q, g, d, True)  # type: ignore[assignment]
    tables = [list(range(-(-s // PAGE))) for s in seq_lens]
    positions = [p for q, s in zip(query_lens, seq_lens) for p in range(s - q, s)]
    batch = last_token_batch([0] * sum(query_lens), positions, query_lens, seq_lens, tables,
                             block_size=PAGE, device=torch.device("cpu"))
    num_blocks = sum(len(t) for t in tables)
    query = torch.zeros(sum(query_lens), HQ, HEAD_DIM, dtype=dtype)
    cache = torch.zeros(num_blocks, PAGE, HKV, HEAD_DIM, dtype=dtype)
    triton_ops.paged_attention(query, cache, cache.clone(), batch.attn, HEAD_DIM ** -0.5,
                               num_splits=1)
    ((args, kwargs),) = capture.launches
    return kernel, args, kwargs


def _measure(dtype: str, query_lens: list[int], seq_lens: list[int]) -> None:
    """Subprocess side: print the launch's tiles and its sm_90 shared memory."""
    kernel, args, kwargs = _gpu_launch(getattr(torch, dtype), query_lens, seq_lens)
    shared = shared_memory_bytes(kernel, args, kwargs, capability=90)
    print(kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs["BLOCK_D"], shared)


@pytest.mark.parametrize(("dtype", "query_lens", "seq_lens", "block_m"), [
    ("bfloat16", [256], [256], 64),  # prefill tiles
    ("bfloat16", [1, 1, 1, 1], [300, 40, 7, 1024], 16),  # decode tiles
    ("float32", [256], [256], 64),
])
def test_attention_tiles_fit_sm90_shared_memory(
    dtype: str, query_lens: list[int], seq_lens: list[int], block_m: int,
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = os.path.dirname(__file__)
    code = (f"import sys; sys.path[:0] = [{here!r}, {os.path.dirname(here)!r}]; "
            f"import test_kernel_smem as t; t._measure({dtype!r}, {query_lens!r}, {seq_lens!r})")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    bm, bn, bd, shared = map(int, done.stdout.split()[-4:])
    assert (bm, bn, bd) == (block_m, 64, 128)
    assert 0 < shared <= SM90_MAX_SHARED, f"{shared} bytes of shared memory per program"
