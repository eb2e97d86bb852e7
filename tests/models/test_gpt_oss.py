"""gpt-oss beyond the shared family tests (tests/models/test_families.py): its config read
as transformers reads it (defaults, alternating windows, refusals), the attention sinks
loaded and mattering, the Triton attention and MoE kernels against transformers, tensor
parallel shards (each rank its heads' sinks) against the whole model."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_models import hf_logits, make_checkpoint
from paged_driver import PagedDriver, one_thread  # noqa: F401 (fixture)

from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.engine.runner.assemble import load_model
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.config import ModelConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tp"))

from thread_comm import run_ranks, thread_group  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 99, 3, 150, 8, 61, 2, 44, 120, 7, 9, 13]  # past the 5-token window


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    folder = tmp_path_factory.mktemp("gpt_oss")
    return make_checkpoint("gpt_oss", folder, seed=1), folder


def _logits(model: Any, prompt: list[int] = PROMPT) -> torch.Tensor:
    driver = PagedDriver(model)
    return driver.forward([(driver.new_seq(prompt, 0), len(prompt))], all_logits=True)


def test_saved_config_reads_as_transformers_builds_it(checkpoint: tuple[Any, Path]) -> None:
    _, folder = checkpoint
    config = ModelConfig.from_pretrained(folder)
    assert config.sliding_windows == (5, None, 5, None)
    assert config.attention_sinks and config.qkv_bias and config.o_bias and not config.tie_word_embeddings
    assert (config.rope.rope_type, config.rope.theta, config.rope.truncate) == ("yarn", 150000.0, False)
    assert config.sparse_layers == (0, 1, 2, 3)
    assert config.moe is not None and config.moe.swiglu_limit == 1.5


def test_absent_keys_take_gpt_oss_defaults() -> None:
    raw = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_hidden_layers": 3,
           "hidden_size": 64, "num_attention_heads": 16, "vocab_size": 100, "intermediate_size": 32,
           "num_local_experts": 4}
    config = ModelConfig.from_hf_config(raw)
    assert config.sliding_windows == (128, None, 128)
    assert (config.head_dim, config.rms_norm_eps, config.num_kv_heads) == (64, 1e-5, 8)
    assert config.qkv_bias and config.o_bias and config.attention_sinks
    rope = config.rope
    assert (rope.rope_type, rope.theta, rope.factor, rope.original_max_position_embeddings) == (
        "yarn", 150000.0, 32.0, 4096)
    assert config.moe is not None and (config.moe.top_k, config.moe.swiglu_limit) == (4, 7.0)
    # a 4.x checkpoint's rope_scaling + top-level rope_theta (the released config.json's shape)
    legacy = ModelConfig.from_hf_config(raw | {"rope_theta": 150000, "rope_scaling": {
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096}})
    assert legacy.rope == rope
    assert ModelConfig.from_hf_config(raw | {"sliding_window": None}).sliding_windows == ()


@pytest.mark.parametrize(("change", "field"), [
    ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "layer_types"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
])
def test_unsupported_fields_are_named(change: dict[str, Any], field: str) -> None:
    raw = {"architectures": ["GptOssForCausalLM"], "num_hidden_layers": 3, "num_local_experts": 4}
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf_config(raw | change)


def test_sinks_are_loaded_and_matter(checkpoint: tuple[Any, Path]) -> None:
    hf, folder = checkpoint
    model = load_model(folder).model
    layer = model.decoder_layers[0].self_attn
    assert layer.sinks is not None and layer.attn.sinks is layer.sinks
    torch.testing.assert_close(layer.sinks, hf.model.layers[0].self_attn.sinks.detach())
    with_sinks = _logits(model)
    torch.testing.assert_close(with_sinks, hf_logits(hf, PROMPT), rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        for block in model.decoder_layers:
            assert block.self_attn.sinks is not None
            block.self_attn.sinks.fill_(float("-inf"))  # no sink term at all
    assert (_logits(model) - with_sinks).abs().max() > 1e-2


def test_batch_invariant_is_refused(checkpoint: tuple[Any, Path]) -> None:
    _, folder = checkpoint
    with pytest.raises(ConfigError, match="batch_invariant=True is not supported for GptOssForCausalLM"):
        load_model(folder, batch_invariant=True)


@pytest.mark.triton
def test_triton_kernels_match_transformers(checkpoint: tuple[Any, Path]) -> None:
    hf, folder = checkpoint
    model = load_model(folder, attention_impl="triton", moe_impl="triton").model
    assert model.decoder_layers[0].self_attn.attn.impl == "triton"
    assert model.decoder_layers[0].sparse_mlp is not None
    torch.testing.assert_close(_logits(model, PROMPT[:9]), hf_logits(hf, PROMPT[:9]), rtol=1e-4, atol=1e-4)


def test_tensor_parallel_shards_hold_their_heads_sinks(checkpoint: tuple[Any, Path]) -> None:
    hf, folder = checkpoint
    whole = load_model(folder, attention_impl="ref", moe_impl="ref").model
    shards = [load_model(folder, attention_impl="ref", moe_impl="ref", tp=c).model for c in thread_group(2)]
    sinks = hf.model.layers[1].self_attn.sinks.detach()
    for rank, shard in enumerate(shards):
        held = shard.decoder_layers[1].self_attn.sinks
        assert held is not None and torch.equal(held, sinks[2 * rank: 2 * rank + 2])

    def run(model: Any) -> tuple[list[list[int]], torch.Tensor]:
        heads = 1 if model.tp is not None else model.config.num_kv_heads  # each rank: 1 of 2 KV heads
        c = model.config
        drivers = []
        for _ in range(2):
            driver = PagedDriver(model, block_size=4)
            driver.cache = PagedKVCache(c.num_layers, 128, 4, heads, c.head_dim, dtype=model.dtype, impl="ref")
            drivers.append(driver)
        tokens = drivers[0].generate([drivers[0].new_seq(PROMPT, 6)], chunk=4)
        seq = drivers[1].new_seq(PROMPT, 0)
        return tokens, drivers[1].forward([(seq, len(PROMPT))], all_logits=True)

    want_tokens, want_logits = run(whole)
    for tokens, logits in run_ranks([lambda m=m: run(m) for m in shards]):
        assert tokens == want_tokens
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)


def test_config_json_written_by_transformers_round_trips(checkpoint: tuple[Any, Path]) -> None:
    _, folder = checkpoint
    raw = json.loads((folder / "config.json").read_text())
    assert ModelConfig.from_hf_config(raw) == ModelConfig.from_pretrained(folder)
