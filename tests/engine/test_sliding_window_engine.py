"""A sliding-window model (Mistral with a 5-token window on every layer) through the whole
engine on the torch reference and on the Triton kernel (the interpreter on CPU): greedy
tokens equal transformers' full forward for prompts longer than the window and decodes
past it, with chunked prefill and prefix-cache hits."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest

from deepinfer_kit import SamplingParams, build_engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

from hf_models import hf_greedy_full, make_checkpoint  # noqa: E402

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("mistral_sliding")
    return folder, make_checkpoint("mistral-sliding", folder, seed=2)


@pytest.mark.parametrize("config", [
    pytest.param({"attention_impl": "ref"}, id="ref"),
    pytest.param({"attention_impl": "triton", "max_num_batched_tokens": 16, "block_size": 8},
                 id="triton-chunked", marks=pytest.mark.triton),
])
def test_greedy_tokens_equal_transformers(mistral: tuple[Path, Any], config: dict[str, Any]) -> None:
    folder, hf_model = mistral
    rng = random.Random(4)
    shared = [rng.randrange(160) for _ in range(17)]
    prompts = [shared + [rng.randrange(160) for _ in range(n)] for n in (3, 11)] + [[rng.randrange(160)] * 2]
    engine = build_engine(model=str(folder), **config)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ids = [engine.add_request(None, p, params) for p in prompts]
    outs = {o.request_id: o for o in engine.run()}
    engine.check_idle()
    assert [outs[i].outputs[0].token_ids for i in ids] == [hf_greedy_full(hf_model, p, NEW_TOKENS) for p in prompts]
