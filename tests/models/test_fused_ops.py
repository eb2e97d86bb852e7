"""Fused decoder ops: each Triton kernel against its torch reference (the interpreter on CPU,
compiled on CUDA), odd sizes and strides, and the model with the Triton ops against the model
with the references."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from paged_driver import PagedDriver, one_thread  # noqa: F401 (fixture)

from deepinfer_kit.engine.runner.assemble import moe_layer_factory
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models import fused_ops
from deepinfer_kit.models.causal_lm import TransformerCausalLM
from deepinfer_kit.models.config import ModelConfig
from deepinfer_kit.models.tiny import tiny_hf_config, tiny_hf_weights

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("one_thread")]

# (T, H): T = 1, hidden sizes that are not powers of two, one wider than a warp's tile.
SHAPES = [(1, 24), (7, 100), (3, 64), (17, 1000)]
# The interpreter rounds to bf16 by truncation, one ulp (2^-8 relative) off torch.
TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}
OPS = ["rms_norm", "add_rms_norm", "silu_and_mul"]


def _kernels() -> Any:
    from deepinfer_kit.models import fused_triton

    return fused_triton


def _rows(gen: torch.Generator, tokens: int, width: int, dtype: torch.dtype, device: str,
          *, scale: float = 1.0, strided: bool = False) -> torch.Tensor:
    """``[T, width]``; with ``strided`` a column slice of a wider tensor (row stride > width)."""
    full = torch.randn(tokens, width + (5 if strided else 0), generator=gen) * scale
    return full.to(dtype).to(device)[:, :width]


def _args(op: str, tokens: int, hidden: int, dtype: torch.dtype, device: str, seed: int,
          strided: bool = False) -> tuple[Any, ...]:
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype).to(device)
    if op == "rms_norm":
        return _rows(gen, tokens, hidden, dtype, device, scale=3.0, strided=strided), weight, 1e-6
    if op == "add_rms_norm":
        x = _rows(gen, tokens, hidden, dtype, device, strided=strided)
        return x, _rows(gen, tokens, hidden, dtype, device, scale=2.0), weight, 1e-5
    return (_rows(gen, tokens, 2 * hidden, dtype, device, scale=3.0, strided=strided),)


def _check(op: str, tokens: int, hidden: int, dtype: torch.dtype, device: str, seed: int,
           strided: bool = False) -> None:
    args = _args(op, tokens, hidden, dtype, device, seed, strided)
    ref: Callable[..., Any] = getattr(fused_ops, op)
    fast: Callable[..., Any] = getattr(_kernels(), op)
    expected, got = ref(*args), fast(*args)
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = got if isinstance(got, tuple) else (got,)
    for e, g in zip(expected, got, strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype and g.device == e.device
        torch.testing.assert_close(g.float(), e.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_reference(op: str, dtype: torch.dtype) -> None:
    for seed, (tokens, hidden) in enumerate(SHAPES):
        _check(op, tokens, hidden, dtype, "cpu", seed)


@pytest.mark.parametrize("op", OPS)
def test_kernel_reads_any_row_stride(op: str) -> None:
    _check(op, 6, 40, torch.float32, "cpu", seed=9, strided=True)


@pytest.mark.parametrize("op", OPS)
def test_zero_rows_give_empty_outputs(op: str) -> None:
    got = getattr(_kernels(), op)(*_args(op, 0, 48, torch.bfloat16, "cpu", seed=0))
    for out in got if isinstance(got, tuple) else (got,):
        assert out.shape == (0, 48) and out.dtype == torch.bfloat16


def test_add_rms_norm_residual_is_the_exact_sum_and_inputs_are_untouched() -> None:
    x, residual, weight, eps = _args("add_rms_norm", 5, 72, torch.float32, "cpu", seed=3)
    before = (x.clone(), residual.clone())
    _, new_residual = _kernels().add_rms_norm(x, residual, weight, eps)
    assert torch.equal(new_residual, x + residual)
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])


def test_bad_shapes_are_refused() -> None:
    kernels = _kernels()
    with pytest.raises(ValueError, match=r"silu_and_mul: expected gate_up \[T, 2I\], got \[3, 5\]"):
        kernels.silu_and_mul(torch.zeros(3, 5))
    with pytest.raises(ValueError, match=r"rms_norm: expected x \[T, H\] and weight \[H\]"):
        kernels.rms_norm(torch.zeros(3, 8), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match=r"residual \[3, 7\] differs from x \[3, 8\]"):
        kernels.add_rms_norm(torch.zeros(3, 8), torch.zeros(3, 7), torch.ones(8), 1e-6)


def test_selection_resolves_once_and_names_the_field() -> None:
    assert fused_ops.select_fused_ops("ref", on_cuda=True) is fused_ops.REFERENCE_OPS
    assert fused_ops.select_fused_ops("auto", on_cuda=False).impl == "ref"
    chosen = fused_ops.select_fused_ops("triton", on_cuda=False)
    assert chosen.impl == "triton" and chosen.add_rms_norm is _kernels().add_rms_norm
    with pytest.raises(ConfigError, match=r"fused_impl must be one of .*, got 'cuda'"):
        fused_ops.select_fused_ops("cuda", on_cuda=True)


def _dense_and_sparse_config() -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The tiny model with a dense first layer (the gated MLP) and non-trivial norm weights."""
    hf = tiny_hf_config()
    hf["mlp_only_layers"] = [0]
    config = ModelConfig.from_hf_config(hf)
    weights = tiny_hf_weights(config, seed=4)
    gen = torch.Generator().manual_seed(1)
    for name in weights:
        if "norm" in name:
            weights[name] = weights[name] + 0.3 * torch.randn(weights[name].shape, generator=gen)
    return config, weights


def _build(config: ModelConfig, weights: dict[str, torch.Tensor], **impls: Any) -> TransformerCausalLM:
    model = TransformerCausalLM(config, sparse_mlp_factory=moe_layer_factory("ref"), **impls)
    model.load_hf_weights(weights)
    return model.eval()


def test_model_with_triton_fused_ops_gives_the_reference_logits() -> None:
    config, weights = _dense_and_sparse_config()
    ref = _build(config, weights, attention_impl="ref")
    fast = _build(config, weights, attention_impl="ref", fused_impl="triton")
    assert (ref.fused_ops.impl, fast.fused_ops.impl) == ("ref", "triton")
    rng = random.Random(0)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(n)] for n in (9, 1, 5)]
    drivers = [PagedDriver(model, block_size=4) for model in (ref, fast)]
    seqs = [[d.new_seq(p, 0) for p in prompts] for d in drivers]
    for step in ([(i, len(p) - 1) for i, p in enumerate(prompts) if len(p) > 1],
                 [(i, 1) for i in range(len(prompts))]):  # prefill, then a decode of every request
        ref_logits, fast_logits = (d.forward([(s[i], n) for i, n in step], all_logits=True)
                                   for d, s in zip(drivers, seqs))
        torch.testing.assert_close(fast_logits, ref_logits, atol=1e-4, rtol=1e-4)


def test_fused_ops_follow_attention_impl_unless_given() -> None:
    config, weights = _dense_and_sparse_config()
    assert _build(config, weights, attention_impl="triton").fused_ops.impl == "triton"
    assert _build(config, weights, attention_impl="triton", fused_impl="ref").fused_ops.impl == "ref"
    with pytest.raises(ConfigError, match="fused_impl must be one of"):
        TransformerCausalLM(config, fused_impl="fast",  # type: ignore[arg-type]
                            sparse_mlp_factory=moe_layer_factory("ref"))


@pytest.mark.cuda
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernel_on_cuda_matches_reference(op: str, dtype: torch.dtype) -> None:
    for seed, (tokens, hidden) in enumerate([*SHAPES, (300, 4096)]):
        _check(op, tokens, hidden, dtype, "cuda", seed)
    _check(op, 6, 40, dtype, "cuda", seed=9, strided=True)


@pytest.mark.cuda
def test_new_batch_sizes_reuse_the_compiled_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """``T`` is the grid, never a kernel argument: other batch sizes compile nothing."""
    import triton

    def run(tokens: int) -> None:
        for op in OPS:
            getattr(_kernels(), op)(*_args(op, tokens, 256, torch.bfloat16, "cuda", seed=tokens))

    run(4)
    compiled: list[str] = []

    def on_compile(**info: Any) -> None:
        compiled.append(info["repr"])

    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", on_compile)
    for tokens in (1, 2, 3, 64, 1000):
        run(tokens)
    assert compiled == []
