"""Tensor-parallel shards of every model family, run side by side as threads: greedy tokens
equal the whole model's, logits within float tolerance, each rank reads only its slices of
the checkpoint and holds about 1/T of the sharded weights."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.engine.runner.assemble import build_tiny_model, load_model
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.causal_lm import TransformerCausalLM
from deepinfer_kit.models.parallel import attention_shard
from deepinfer_kit.models.weights import SafetensorsWeights
from thread_comm import run_ranks, thread_group

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

from hf_models import make_checkpoint  # noqa: E402
from paged_driver import PagedDriver, one_thread  # noqa: E402,F401

pytestmark = pytest.mark.usefixtures("one_thread")

# dense with KV heads = T, MQA + tied + biases (KV heads < T), tied + q/k norm, MoE with a
# shared expert, MoE with shared experts and a dense first layer, plain routed MoE, Gemma 3
# (scaled vocab-parallel embeddings, sandwich norms after the row-parallel all-reduce).
FAMILIES = ("llama", "llama-llama3", "qwen3", "qwen2_moe", "glm4_moe", "qwen3_moe", "gemma3")
PROMPTS = ([3, 17, 99, 4, 150, 8, 61], [120, 5, 5, 42])


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp_ckpt")
    made = {}
    for family in FAMILIES:
        make_checkpoint(family, root / family, seed=3)
        made[family] = root / family
    return made


def _driver(model: TransformerCausalLM) -> PagedDriver:
    driver = PagedDriver(model, num_blocks=64, block_size=4)
    heads = model.config.num_kv_heads if model.tp is None else attention_shard(
        model.config, model.tp.world_size, model.tp.rank).num_kv_heads
    c = model.config
    driver.cache = PagedKVCache(c.num_layers, 64, 4, heads, c.head_dim, dtype=model.dtype, impl="ref")
    return driver


def _generate(model: TransformerCausalLM) -> tuple[list[list[int]], torch.Tensor]:
    driver = _driver(model)
    logits = driver.forward([(driver.new_seq(PROMPTS[0], 1), len(PROMPTS[0]))], all_logits=True)
    seqs = [driver.new_seq(p, 6) for p in PROMPTS]
    return driver.generate(seqs, chunk=3), logits


def _compare(whole: TransformerCausalLM, shards: list[TransformerCausalLM]) -> None:
    want_tokens, want_logits = _generate(whole)
    got = run_ranks([lambda m=m: _generate(m) for m in shards])
    for tokens, logits in got:
        assert tokens == want_tokens
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)


CASES = [pytest.param(f, w, id=f"{f}-{w}",
                      marks=[pytest.mark.slow] if w == 4 and f != "llama" else [])
         for f in FAMILIES for w in (2, 4)]  # llama at 4: two KV heads, each on two ranks


@pytest.mark.parametrize(("family", "world"), CASES)
def test_shards_generate_the_whole_models_tokens(family: str, world: int, folders: dict[str, Path]) -> None:
    whole = load_model(folders[family], attention_impl="ref", moe_impl="ref").model
    comms = thread_group(world)
    shards = [load_model(folders[family], attention_impl="ref", moe_impl="ref", tp=c).model for c in comms]
    _compare(whole, shards)
    assert all(c.calls > 0 for c in comms)


def test_the_tiny_default_model_under_tensor_parallelism() -> None:
    """The embedded model: vocabulary 259 (padded to 2 x 130 rows), 8 routed experts."""
    whole = build_tiny_model(seed=5, attention_impl="ref", moe_impl="ref").model
    shards = [build_tiny_model(seed=5, attention_impl="ref", moe_impl="ref", tp=c).model
              for c in thread_group(2)]
    assert shards[1].embed_tokens.shape[0] == 130
    _compare(whole, shards)


class _CountingWeights(SafetensorsWeights):
    whole: list[str] = []

    def __getitem__(self, name: str) -> torch.Tensor:
        type(self).whole.append(name)
        return super().__getitem__(name)


SHARDED = ("q_proj", "k_proj", "v_proj", "o_proj", "embed_tokens", "lm_head")


@pytest.mark.parametrize("family", ["llama", "glm4_moe"])
def test_a_rank_reads_only_its_slices(family: str, folders: dict[str, Path],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The sharded tensors are read with safetensors' get_slice, never whole; dense MLPs
    too (the MoE experts are held whole: replicated, or split by expert parallelism)."""
    import deepinfer_kit.models.loader as loader

    monkeypatch.setattr(loader, "SafetensorsWeights", _CountingWeights)
    _CountingWeights.whole = []
    load_model(folders[family], tp=thread_group(2)[1])
    whole = _CountingWeights.whole
    assert whole, "the norms are read whole"
    bad = [n for n in whole if any(s in n for s in SHARDED) or ".mlp.gate_proj" in n
           or ".mlp.up_proj" in n or ".mlp.down_proj" in n]
    assert not bad


def _bytes(model: torch.nn.Module, keep: Any = lambda name: True) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if keep(n))


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_holds_a_tth_of_the_dense_weights(world: int, folders: dict[str, Path]) -> None:
    """Replicated: the norms, and with fewer KV heads than ranks one KV head per rank."""
    whole = load_model(folders["llama"]).model
    c = whole.config
    replicated = _bytes(whole, lambda n: "norm" in n or n.endswith("o_proj.bias") or n.endswith("down.bias"))
    if c.num_kv_heads < world:
        replicated += c.num_layers * 2 * c.head_dim * c.hidden_size * 4  # one KV head's k and v rows
    for comm in thread_group(world):
        shard = load_model(folders["llama"], tp=comm).model
        assert _bytes(shard) <= (_bytes(whole) - replicated) / world + replicated


@pytest.mark.parametrize(("heads", "kv", "world", "match"), [
    (4, 2, 3, "num_attention_heads"), (12, 3, 4, "num_key_value_heads"), (12, 6, 4, "num_key_value_heads")])
def test_heads_that_do_not_split_are_a_config_error(heads: int, kv: int, world: int, match: str) -> None:
    from deepinfer_kit.models.config import ModelConfig

    config = ModelConfig.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32,
        "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": heads, "num_key_value_heads": kv})
    with pytest.raises(ConfigError, match=match):
        attention_shard(config, world, 1)
