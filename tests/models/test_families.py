"""Every family against ``transformers`` with the same tiny random weights from a real folder.

Logits of a prompt agree within fp32 tolerance; greedy decoding through the paged cache
(chunked prefill mixed with other requests' decodes, and a prefix-cache hit reusing another
request's blocks) gives exactly ``transformers``' greedy tokens.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_models import FAMILIES, hf_greedy, hf_logits, make_checkpoint
from paged_driver import PagedDriver, one_thread  # noqa: F401 (fixture)

from deepinfer_kit.engine.runner.assemble import load_model
from deepinfer_kit.models.loader import LoadedModel

NEW_TOKENS = 8

pytestmark = pytest.mark.usefixtures("one_thread")


class Checkpoints(dict[str, tuple[Any, Path]]):
    """Each family's (transformers model, checkpoint folder), built on first use."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        super().__init__()
        self.factory = factory

    def __missing__(self, family: str) -> tuple[Any, Path]:
        folder = self.factory.mktemp(family)
        self[family] = (make_checkpoint(family, folder), folder)
        return self[family]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(tmp_path_factory)


def _prompts(vocab: int, seed: int) -> tuple[list[int], list[int], list[int]]:
    rng = random.Random(seed)
    a = [rng.randrange(vocab) for _ in range(11)]
    b = [rng.randrange(vocab) for _ in range(6)]
    c = a[:8] + [rng.randrange(vocab) for _ in range(5)]  # shares two 4-token blocks with a
    return a, b, c


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logits_match_transformers(family: str, checkpoints: Checkpoints) -> None:
    hf, folder = checkpoints[family]
    loaded: LoadedModel = load_model(folder)
    assert loaded.config.architecture == hf.config.architectures[0]
    prompt = _prompts(loaded.config.vocab_size, 1)[0]
    driver = PagedDriver(loaded.model)
    ours = driver.forward([(driver.new_seq(prompt, 0), len(prompt))], all_logits=True)
    expected = hf_logits(hf, prompt)
    assert ours.dtype == torch.float32 and ours.shape == expected.shape
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_paged_decoding_matches_transformers(family: str, checkpoints: Checkpoints) -> None:
    hf, folder = checkpoints[family]
    model = load_model(folder).model
    a, b, c = _prompts(model.config.vocab_size, 2)
    driver = PagedDriver(model, block_size=4)
    first = [driver.new_seq(a, NEW_TOKENS), driver.new_seq(b, NEW_TOKENS, start_step=1)]
    # 3-token chunks: a prefills over 4 steps while b joins, prefills and decodes beside it.
    got = driver.generate(first, chunk=3)
    hit = driver.new_seq(c, NEW_TOKENS, prefix_of=first[0], prefix_blocks=2)
    got += driver.generate([hit], chunk=2)
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in (a, b, c)]
    assert got == expected
    # The hit reused a's blocks: its table starts with them and only its tail was computed.
    assert hit.table[:2] == first[0].table[:2]


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe", "deepseek_v3"])
def test_expert_counts_follow_the_last_forward(family: str, checkpoints: Checkpoints) -> None:
    hf, folder = checkpoints[family]
    model = load_model(folder).model
    config = model.config
    assert config.moe is not None
    driver = PagedDriver(model)
    prompt = _prompts(config.vocab_size, 3)[0]
    driver.forward([(driver.new_seq(prompt, 0), len(prompt))])
    counts = model.expert_counts()
    assert counts is not None and counts.dtype == torch.int64
    assert counts.shape == (len(config.sparse_layers), config.moe.num_experts)
    # Every token picks top_k distinct experts in every sparse layer.
    assert counts.sum(dim=1).tolist() == [len(prompt) * config.moe.top_k] * len(config.sparse_layers)


def test_dense_model_has_no_expert_counts(checkpoints: Checkpoints) -> None:
    _, folder = checkpoints["llama"]
    model = load_model(folder).model
    driver = PagedDriver(model)
    driver.forward([(driver.new_seq([1, 2, 3], 0), 3)])
    assert model.expert_counts() is None


def test_bfloat16_load_tracks_float32(checkpoints: Checkpoints) -> None:
    _, folder = checkpoints["qwen3"]
    ref = load_model(folder).model
    low = load_model(folder, dtype=torch.bfloat16).model
    assert low.embed_tokens.dtype == torch.bfloat16
    prompt = _prompts(ref.config.vocab_size, 4)[0]
    outs = []
    for model in (ref, low):
        driver = PagedDriver(model)
        outs.append(driver.forward([(driver.new_seq(prompt, 0), len(prompt))], all_logits=True))
    assert outs[1].dtype == torch.float32
    # bf16 keeps ~3 significant digits; logits here are O(10).
    assert (outs[0] - outs[1]).abs().max() < 0.1 * outs[0].abs().max()
