"""The fused q/k norm + RoPE + KV-cache write: the Triton kernel against its torch reference
(the interpreter on CPU, compiled on CUDA) over random shapes, padded slots, and a model's
logits with the fused path against the unfused one on a dense and an MoE tiny family."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from paged_driver import PagedDriver, one_thread  # noqa: F401 (fixture)

from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.engine.runner.assemble import moe_layer_factory
from deepinfer_kit.models import fused_ops, rope_kv
from deepinfer_kit.models.causal_lm import TransformerCausalLM
from deepinfer_kit.models.config import ModelConfig
from deepinfer_kit.models.tiny import tiny_hf_config, tiny_hf_weights

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("one_thread")]

TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    # The interpreter rounds to bf16 by truncation, one ulp (2^-8 relative) off torch.
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}
BLOCK_SIZE = 4


def _kernel() -> Any:
    from deepinfer_kit.models import rope_kv_triton

    return rope_kv_triton.rope_kv_write


def _case(seed: int, tokens: int, hq: int, hkv: int, d: int, rot: int, norm: bool,
          dtype: torch.dtype, device: str, pads: int = 0) -> tuple[tuple[Any, ...], PagedKVCache]:
    """Arguments of the op and the cache they write (random contents); the last ``pads``
    rows of the slot mapping are the pad slot."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen) * 2).to(dtype).to(device)
    weight = ((torch.rand(hq + hkv, d, generator=gen) + 0.5).to(dtype).to(device)
              if norm else None)
    angles = torch.rand(tokens, 1, rot // 2, generator=gen) * 50
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype).to(device)
    sin = torch.cat((-angles.sin(), angles.sin()), -1).to(dtype).to(device)
    cache = PagedKVCache(1, tokens // BLOCK_SIZE + 3, BLOCK_SIZE, hkv, d, dtype=dtype, device=device, impl="ref")
    for part in cache.slot_caches(0):
        part.copy_(torch.randn(part.shape, generator=gen).to(dtype))
    live = tokens - pads
    slots = torch.randperm(cache.pad_slot, generator=gen)[:live].tolist()
    slot_mapping = torch.tensor(slots + [cache.pad_slot] * pads, dtype=torch.int64, device=device)
    keys, values = cache.slot_caches(0)
    return (qkv, weight, 1e-6, cos, sin, keys, values, slot_mapping, hq), cache


def _check(seed: int, tokens: int, hq: int, hkv: int, d: int, rot: int, norm: bool,
           dtype: torch.dtype, device: str = "cpu", pads: int = 0) -> None:
    ref_args, ref_cache = _case(seed, tokens, hq, hkv, d, rot, norm, dtype, device, pads)
    got_args, got_cache = _case(seed, tokens, hq, hkv, d, rot, norm, dtype, device, pads)
    before = ref_cache.key_cache(0).clone(), ref_cache.value_cache(0).clone()
    qkv_before = got_args[0].clone()
    want = rope_kv.rope_kv_write(*ref_args)
    got = _kernel()(*got_args)
    assert got.shape == (tokens, hq, d) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])
    # Only the addressable blocks: the pad slot may be written by several rows.
    for cache_got, cache_want in ((got_cache.key_cache(0), ref_cache.key_cache(0)),
                                  (got_cache.value_cache(0), ref_cache.value_cache(0))):
        torch.testing.assert_close(cache_got.float(), cache_want.float(), **TOLERANCE[dtype])
    written = torch.zeros(got_cache.pad_slot, dtype=torch.bool)
    written[[s for s in got_args[7].tolist() if s < got_cache.pad_slot]] = True
    for cache_got, old in ((got_cache.key_cache(0), before[0]), (got_cache.value_cache(0), before[1])):
        untouched = cache_got.reshape(-1, hkv, d)[~written.to(device)]
        assert torch.equal(untouched, old.reshape(-1, hkv, d)[~written.to(device)])
    assert torch.equal(got_args[0], qkv_before)


# (T, Hq, Hkv, D, rot): T 1 and odd; GQA, MHA and MQA; the tiny model's D=16, 64, 128;
# full and partial rotary.
SHAPES = [(1, 4, 2, 16, 16), (5, 2, 1, 64, 64), (7, 4, 4, 16, 8), (3, 2, 2, 128, 64),
          (1, 8, 2, 128, 128), (9, 3, 1, 64, 32)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
def test_kernel_matches_reference(dtype: torch.dtype, norm: bool) -> None:
    for seed, shape in enumerate(SHAPES):
        _check(seed, *shape, norm=norm, dtype=dtype)


@pytest.mark.parametrize("norm", [True, False])
def test_padded_rows_write_only_the_pad_slot(norm: bool) -> None:
    _check(11, 7, 4, 2, 16, 16, norm, torch.float32, pads=3)
    _check(12, 3, 2, 1, 64, 32, norm, torch.bfloat16, pads=3)  # every row padded


def test_zero_tokens_and_bad_shapes() -> None:
    args, _ = _case(0, 0, 4, 2, 16, 16, True, torch.float32, "cpu")
    assert _kernel()(*args).shape == (0, 4, 16)
    args, _ = _case(0, 3, 4, 2, 16, 16, True, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"rope_kv_write: shapes disagree: qkv \[3, 128\], num_heads 3"):
        _kernel()(*args[:-1], 3)


def test_selection_and_unsupported_configs_take_the_unfused_path() -> None:
    assert fused_ops.REFERENCE_OPS.rope_kv is None
    assert fused_ops.select_fused_ops("triton", on_cuda=False).rope_kv is _kernel()
    assert fused_ops.select_fused_ops("auto", on_cuda=False).rope_kv is None
    wide = tiny_hf_config()
    wide["head_dim"] = 1024
    config = ModelConfig.from_hf_config(wide)
    assert rope_kv.rope_kv_unsupported(config) == "head_dim 1024 > 512"
    model = TransformerCausalLM(config, attention_impl="ref", fused_impl="triton",
                                sparse_mlp_factory=moe_layer_factory("ref"))
    assert model.rope_kv_reason == "head_dim 1024 > 512"
    assert all(layer.self_attn.rope_kv is None for layer in model.decoder_layers)
    ref = TransformerCausalLM(ModelConfig.from_hf_config(tiny_hf_config()),
                              sparse_mlp_factory=moe_layer_factory("ref"))
    assert ref.rope_kv_reason == "the fused ops are the torch references"


def _family(name: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The tiny MoE model (q/k norm), or a dense Llama with partial rotary and no q/k norm."""
    hf = tiny_hf_config()
    if name == "dense":
        hf.update(architectures=["LlamaForCausalLM"], model_type="llama", partial_rotary_factor=0.5)
        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                    "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob"):
            hf.pop(key)
    config = ModelConfig.from_hf_config(hf)
    weights = tiny_hf_weights(config, seed=5)
    gen = torch.Generator().manual_seed(2)
    for key in list(weights):
        if "_norm." in key and not config.qk_norm:
            del weights[key]
        elif "norm" in key:
            weights[key] = weights[key] + 0.3 * torch.randn(weights[key].shape, generator=gen)
    return config, weights


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_model_logits_with_the_fused_path_equal_the_unfused_path(family: str) -> None:
    config, weights = _family(family)
    assert config.qk_norm == (family == "moe")
    assert (config.rope.rotary_dim < config.head_dim) == (family == "dense")
    models = []
    for impl in ("ref", "triton"):
        model = TransformerCausalLM(config, attention_impl="ref", fused_impl=impl,
                                    sparse_mlp_factory=moe_layer_factory("ref"))
        model.load_hf_weights(weights)
        models.append(model.eval())
    assert models[1].rope_kv_reason is None and models[1].decoder_layers[0].self_attn.rope_kv
    rng = random.Random(1)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(n)] for n in (9, 1, 6)]
    drivers = [PagedDriver(model, block_size=4) for model in models]
    seqs = [[d.new_seq(p, 0) for p in prompts] for d in drivers]
    steps = ([(i, len(p) - 1) for i, p in enumerate(prompts) if len(p) > 1],
             [(i, 1) for i in range(len(prompts))])
    for step in steps:  # a prefill, then a step that reads the fused path's cached K/V
        want, got = (d.forward([(s[i], n) for i, n in step], all_logits=True)
                     for d, s in zip(drivers, seqs))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernel_on_cuda_matches_reference(dtype: torch.dtype) -> None:
    for norm in (True, False):
        for seed, shape in enumerate([*SHAPES, (300, 16, 8, 128, 128)]):
            _check(seed, *shape, norm=norm, dtype=dtype, device="cuda")
        _check(21, 9, 4, 2, 64, 64, norm, dtype, device="cuda", pads=4)
