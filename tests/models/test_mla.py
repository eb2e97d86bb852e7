"""DeepSeek-V3 multi-head latent attention: the latent row in the pool (what transformers
caches, nothing more), the absorbed form equal to the expanded one on the same rows (the
torch reference and the Triton kernel), a mixed step the same whichever form each request
takes, the softmax scale, and the refusals."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hf_models import make_checkpoint
from paged_driver import PagedDriver, one_thread  # noqa: F401 (fixture)

from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.engine.runner.assemble import load_model
from deepinfer_kit.errors import ConfigError, InvariantError
from deepinfer_kit.models.attention import make_attention_metadata
from deepinfer_kit.models.attention.mla_ref import (
    absorbed_attention,
    expanded_attention,
    select_latent_op,
    split_forms,
)
from deepinfer_kit.models.config import ModelConfig
from deepinfer_kit.models.mla import LatentSelfAttention
from deepinfer_kit.models.records import AttentionMetadata

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    folder = tmp_path_factory.mktemp("deepseek_v3")
    return make_checkpoint("deepseek_v3", folder, seed=5), folder


def test_config_and_softmax_scale_follow_transformers(deepseek: tuple[Any, Path]) -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    hf, _ = deepseek
    config = ModelConfig.from_hf_config(hf.config.to_dict())
    mla = config.mla
    assert mla is not None and (mla.kv_lora_rank, mla.qk_rope_head_dim, mla.q_lora_rank) == (32, 8, 24)
    # the one cached "head": the latent row (a pool built from these has the row's shape)
    assert (config.num_kv_heads, config.head_dim) == (1, 32 + 8)
    assert (config.rope.rotary_dim, config.sparse_layers) == (8, (1, 2))
    # YaRN's mscale_all_dim scales the softmax: 24 ** -0.5 * (0.1 ln 16 + 1) ** 2.
    assert mla.softmax_scale(config.rope) == pytest.approx(DeepseekV3Attention(hf.config, 0).scaling, rel=1e-12)
    assert mla.softmax_scale(config.rope) != pytest.approx(24 ** -0.5)
    row = config.cache_row()
    assert (row.num_heads, row.head_dim, row.keys_only) == (1, 40, True)
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        ModelConfig.from_hf_config({k: v for k, v in hf.config.to_dict().items() if k != "kv_lora_rank"})


def test_the_pool_holds_transformers_latent_row_and_nothing_more(deepseek: tuple[Any, Path]) -> None:
    hf, folder = deepseek
    model = load_model(folder).model
    driver = PagedDriver(model, block_size=4)
    cache, c, r = driver.cache, 32, 8
    assert cache.keys_only and cache.key_cache(0).shape == (cache.num_blocks, 4, 1, c + r)
    assert PagedKVCache.bytes_per_block(3, 4, 1, c + r, torch.float32, keys_only=True) == 3 * 4 * (c + r) * 4
    assert cache._kv.numel() * 4 == (cache.num_blocks + 1) * 3 * 4 * (c + r) * 4
    prompt = [random.Random(0).randrange(160) for _ in range(9)]
    seq = driver.new_seq(prompt, 0)
    driver.forward([(seq, len(prompt))])
    slots = torch.tensor([seq.table[t // 4] * 4 + t % 4 for t in range(len(prompt))])
    with torch.no_grad():
        past = hf(torch.tensor([prompt]), use_cache=True).past_key_values
    for layer in range(3):
        ours = cache.key_cache(layer).reshape(-1, c + r)[slots]
        # transformers caches the normed latent as "keys" and the rotated shared key as "values"
        theirs = torch.cat([past.layers[layer].keys[0, 0], past.layers[layer].values[0, 0]], dim=-1)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def _latent_case(seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """A random step of mixed requests over a shuffled latent pool; ``(q_nope, q_rope,
    rows, kv_b, meta)`` with ``Hq`` 4, ``dn`` 8, ``dr`` 4, ``C`` 12, ``dv`` 6."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [(1, 9), (5, 5), (1, 1), (3, 14), (1, 22)]
    blocks = torch.randperm(40, generator=gen).tolist()
    tables = [[blocks.pop() for _ in range(-(-s // 4))] for _, s in lengths]
    meta = make_attention_metadata([q for q, _ in lengths], [s for _, s in lengths], tables, 4)
    tokens = sum(q for q, _ in lengths)
    rows = torch.randn(40, 4, 1, 16, generator=gen, dtype=dtype)
    return (torch.randn(tokens, 4, 8, generator=gen, dtype=dtype), torch.randn(tokens, 4, 4, generator=gen, dtype=dtype),
            rows, torch.randn(4 * 14, 12, generator=gen, dtype=dtype) / 4, meta)  # type: ignore[return-value]


def test_absorbed_form_equals_expanded_form_on_the_same_rows() -> None:
    q_nope, q_rope, rows, kv_b, meta = _latent_case(1, torch.float64)
    assert isinstance(meta, AttentionMetadata)
    every = tuple(split_forms(meta, 0).expanded)
    expanded = torch.zeros(q_nope.shape[0], 4, 6, dtype=torch.float64)
    expanded_attention(q_nope, q_rope, rows, kv_b, meta, every, 0.3, expanded)
    absorbed = absorbed_attention(q_nope, q_rope, rows, kv_b, meta, 0.3)
    torch.testing.assert_close(absorbed, expanded, rtol=1e-5, atol=1e-5)  # fp32 softmax inside both


@pytest.mark.triton
def test_triton_absorbed_form_matches_the_reference() -> None:
    """Decodes and multi-token queries (``_latent_case`` mixes them) through the kernel."""
    q_nope, q_rope, rows, kv_b, meta = _latent_case(2, torch.float32)
    assert isinstance(meta, AttentionMetadata)
    ref = absorbed_attention(q_nope, q_rope, rows, kv_b, meta, 0.3)
    kernel, impl = select_latent_op("triton", "cpu")
    assert impl == "triton"
    torch.testing.assert_close(absorbed_attention(q_nope, q_rope, rows, kv_b, meta, 0.3, kernel), ref,
                               rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("max_absorbed", [0, 3, 1 << 20])
def test_a_mixed_step_is_the_same_whichever_form_each_request_takes(
        deepseek: tuple[Any, Path], max_absorbed: int) -> None:
    _, folder = deepseek
    rng = random.Random(3)
    prompts = [rng.randrange(160) for _ in range(10)], [rng.randrange(160) for _ in range(7)]
    logits = []
    for absorbed in (1, max_absorbed):  # 1: the default split (decodes absorbed)
        model = load_model(folder).model
        for layer in model.decoder_layers:
            assert isinstance(layer.self_attn, LatentSelfAttention)
            layer.self_attn.max_absorbed = absorbed
        driver = PagedDriver(model, block_size=4)
        a, b = (driver.new_seq(p, 0) for p in prompts)
        driver.forward([(a, 6), (b, 4)])  # two prefill chunks
        # a 3-token chunk beside a 1-token step, then the reverse: both forms in one step
        first = driver.forward([(a, 3), (b, 1)], all_logits=True)
        second = driver.forward([(a, 1), (b, 2)], all_logits=True)
        logits.append(torch.cat([first, second]))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def test_tensor_parallel_batch_invariance_and_a_kv_pool_are_refused(deepseek: tuple[Any, Path]) -> None:
    hf, folder = deepseek
    config = ModelConfig.from_hf_config(hf.config.to_dict())
    model = load_model(folder).model
    rotary = model.rotary
    tp = SimpleNamespace(world_size=2, rank=0)
    with pytest.raises(ConfigError, match="tensor_parallel_size=2"):
        LatentSelfAttention(config, 0, rotary, attention_impl="ref", dtype=torch.float32, device="cpu",
                            tp=tp)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="batch_invariant=True"):
        LatentSelfAttention(config, 0, rotary, attention_impl="ref", dtype=torch.float32, device="cpu",
                            batch_invariant=True)
    assert config.mla is not None
    kv_pool = PagedKVCache(3, 8, 4, config.num_heads, config.mla.qk_head_dim)  # per-head K/V
    meta = make_attention_metadata([2], [2], [[0]], 4)
    with pytest.raises(InvariantError, match=r"latent KV pool of \[NB, P, 1, 40\]"):
        model.decoder_layers[0].self_attn.forward(torch.zeros(2, 64), *model.rotary.cos_sin(torch.arange(2), torch.float32),
                                                  kv_pool, meta)
