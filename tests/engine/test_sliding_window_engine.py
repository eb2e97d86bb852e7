"""Sliding-window models through the whole engine on the torch reference and on the Triton
kernel (the interpreter on CPU): Mistral (a 5-token window on every layer; oracle:
transformers' full forward per token) and Gemma 3 text (5 local : 1 global layers, a 5-token
window, two RoPEs, sandwich and (1 + w) norms, scaled embeddings; oracle: transformers'
``generate``). Greedy tokens equal the oracle's for prompts longer than the window and
decodes past it, with chunked prefill and prefix-cache hits."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest

from deepinfer_kit import SamplingParams, build_engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

from hf_models import hf_greedy, hf_greedy_full, make_checkpoint  # noqa: E402

NEW_TOKENS = 10

# family -> (prompt seed, oracle)
FAMILIES = {"mistral-sliding": (4, hf_greedy_full), "gemma3": (5, hf_greedy)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    out = {}
    for family in FAMILIES:
        folder = tmp_path_factory.mktemp(family)
        out[family] = (folder, make_checkpoint(family, folder, seed=2))
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("config", [
    pytest.param({"attention_impl": "ref"}, id="ref"),
    pytest.param({"attention_impl": "triton", "max_num_batched_tokens": 16, "block_size": 8},
                 id="triton-chunked", marks=pytest.mark.triton),
])
def test_greedy_tokens_equal_transformers(checkpoints: dict[str, tuple[Path, Any]], family: str,
                                          config: dict[str, Any]) -> None:
    folder, hf_model = checkpoints[family]
    seed, oracle = FAMILIES[family]
    rng = random.Random(seed)
    shared = [rng.randrange(160) for _ in range(17)]
    prompts = [shared + [rng.randrange(160) for _ in range(n)] for n in (3, 11)] + [[rng.randrange(160)] * 2]
    engine = build_engine(model=str(folder), **config)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ids = [engine.add_request(None, p, params) for p in prompts]
    outs = {o.request_id: o for o in engine.run()}
    engine.check_idle()
    assert [outs[i].outputs[0].token_ids for i in ids] == [oracle(hf_model, p, NEW_TOKENS) for p in prompts]
