"""DeepSeek-V3 (multi-head latent attention over a latent pool, DeepSeek MoE routing)
through the whole engine: greedy tokens equal transformers' generate with chunked prefill,
decodes beside prefill chunks and a prefix-cache hit, on the torch reference and on the
Triton kernels (the interpreter on CPU, a slow test); the pool is one latent row per token and layer,
sized from the budget by those bytes."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest

from deepinfer_kit import SamplingParams, build_engine
from deepinfer_kit.cache.kv_cache import PagedKVCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

from hf_models import hf_greedy, make_checkpoint  # noqa: E402

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("deepseek_v3")
    return folder, make_checkpoint("deepseek_v3", folder, seed=2)


@pytest.mark.parametrize("config", [
    pytest.param({"attention_impl": "ref", "moe_impl": "ref"}, id="ref"),
    # ~10 s under the interpreter (every norm, MoE and attention launch interpreted): slow
    pytest.param({"attention_impl": "triton", "moe_impl": "triton"}, id="triton",
                 marks=[pytest.mark.triton, pytest.mark.slow]),
])
def test_greedy_tokens_equal_transformers(deepseek: tuple[Path, Any], config: dict[str, Any]) -> None:
    folder, hf_model = deepseek
    rng = random.Random(4)
    shared = [rng.randrange(160) for _ in range(17)]  # two full blocks of 8: a prefix hit
    prompts = [shared + [rng.randrange(160) for _ in range(n)] for n in (3, 9)] + [[rng.randrange(160)] * 2]
    engine = build_engine(model=str(folder), max_num_batched_tokens=12, block_size=8, **config)
    cache = engine.runner.kv_cache
    assert isinstance(cache, PagedKVCache) and cache.keys_only
    assert (cache.num_kv_heads, cache.head_dim) == (1, 32 + 8)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ids = [engine.add_request(None, p, params) for p in prompts]
    outs = {o.request_id: o for o in engine.run()}
    engine.check_idle()
    assert [outs[i].outputs[0].token_ids for i in ids] == [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]


def test_the_pool_is_sized_by_the_latent_row(deepseek: tuple[Path, Any]) -> None:
    folder, _ = deepseek
    engine = build_engine(model=str(folder), kv_cache_memory_mb=1, block_size=8)
    per_block = 3 * 8 * (32 + 8) * 4  # L x P x (kv_lora_rank + qk_rope_head_dim) x fp32
    assert engine.runner.kv_cache.num_blocks == (1 << 20) // per_block
