"""The embedded tiny model and the forward contract: determinism, batch layout invariance,
logits rows, expert counts; and the byte tokenizer."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from hf_models import hf_greedy
from hypothesis import given
from hypothesis import strategies as st
from paged_driver import PagedDriver, one_thread  # noqa: F401 (fixture)
from safetensors.torch import save_file

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.engine.runner.assemble import build_tiny_model
from deepinfer_kit.models.loader import LoadedModel
from deepinfer_kit.models.tiny import tiny_hf_config, tiny_hf_weights
from deepinfer_kit.models.tokenizer import ByteTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return build_tiny_model(seed=0)


def test_same_seed_same_model_other_seed_other_model() -> None:
    a, b, c = build_tiny_model(seed=5), build_tiny_model(seed=5), build_tiny_model(seed=6)
    for (name, pa), (_, pb), (_, pc) in zip(a.model.named_parameters(), b.model.named_parameters(),
                                            c.model.named_parameters()):
        assert torch.equal(pa, pb), name
        if "norm" not in name:  # norm weights are all ones under every seed
            assert not torch.equal(pa, pc), name


def test_tiny_model_shape(tiny: LoadedModel) -> None:
    config = tiny.config
    assert config.architecture == "Qwen3MoeForCausalLM"
    assert config.vocab_size == tiny.tokenizer.vocab_size == 259
    assert config.eos_token_ids == (tiny.tokenizer.eos_token_id,)
    assert config.moe is not None and (config.moe.num_experts, config.moe.top_k) == (8, 2)
    assert tiny.model.config is config


def test_expert_counts_before_and_after_forward() -> None:
    fresh = build_tiny_model(seed=1)
    assert fresh.model.expert_counts() is None
    driver = PagedDriver(fresh.model)
    driver.forward([(driver.new_seq([1, 2, 3, 4, 5], 0), 5)])
    counts = fresh.model.expert_counts()
    assert counts is not None and counts.shape == (2, 8) and counts.dtype == torch.int64
    assert counts.sum(dim=1).tolist() == [5 * 2, 5 * 2]


@pytest.mark.parametrize("seed", range(6))
def test_logits_do_not_depend_on_batch_layout(tiny: LoadedModel, seed: int) -> None:
    """A request's logits are the same alone and mixed with other requests' prefill and
    decode chunks in any order (the property the engine's batching relies on)."""
    rng = random.Random(seed)
    vocab = tiny.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(2, 14))] for _ in range(4)]

    def last_logits(order: list[int], chunk: int) -> dict[int, torch.Tensor]:
        driver = PagedDriver(tiny.model, block_size=rng.choice([1, 2, 4, 16]))
        seqs = [(i, driver.new_seq(prompts[i], 0)) for i in order]
        last: dict[int, torch.Tensor] = {}
        while pending := [(i, s) for i, s in seqs if s.computed < len(s.tokens)]:
            chunks = [(s, min(chunk, len(s.tokens) - s.computed)) for _, s in pending]
            for (i, _), row in zip(pending, driver.forward(chunks)):
                last[i] = row
        return last

    alone = {i: last_logits([i], 1 << 30)[i] for i in range(4)}
    order = list(range(4))
    rng.shuffle(order)
    mixed = last_logits(order, rng.randint(1, 5))
    for i in range(4):
        torch.testing.assert_close(mixed[i], alone[i], rtol=1e-5, atol=1e-5)


def test_logits_indices_select_rows(tiny: LoadedModel) -> None:
    prompt = [10, 20, 30, 40, 50, 60, 70]
    full = PagedDriver(tiny.model)
    every = full.forward([(full.new_seq(prompt, 0), 7)], all_logits=True)
    assert every.shape == (7, 259) and every.dtype == torch.float32
    last = PagedDriver(tiny.model)
    only = last.forward([(last.new_seq(prompt, 0), 7)])
    torch.testing.assert_close(only, every[-1:], rtol=1e-5, atol=1e-5)


def test_greedy_generation_is_reproducible_and_matches_transformers(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """The tiny model's weights saved as a checkpoint and run by ``transformers`` (the
    oracle) give the same greedy tokens, so a wrong but deterministic model fails."""
    import transformers

    config = tiny_hf_config()
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tiny_hf_weights(tiny.config, seed=0), str(tmp_path / "model.safetensors"))
    oracle = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    for text in ("Hello", "Paged attention reads blocks"):
        prompt = tiny.tokenizer.encode(text)
        outs = []
        for _ in range(2):
            driver = PagedDriver(tiny.model)
            outs.append(driver.generate([driver.new_seq(prompt, 12)])[0])
        assert outs[0] == outs[1] and len(outs[0]) == 12
        assert len(set(outs[0])) > 1  # not a degenerate repeat of one token
        assert outs[0] == hf_greedy(oracle, prompt, 12), text


@pytest.mark.triton
def test_triton_kernels_give_the_reference_tokens(tiny: LoadedModel) -> None:
    fast = build_tiny_model(seed=0, attention_impl="triton", moe_impl="triton")
    prompt = tiny.tokenizer.encode("Hi there")
    outs = []
    for model in (tiny.model, fast.model):
        driver = PagedDriver(model, block_size=4)
        outs.append(driver.generate([driver.new_seq(prompt, 3)], chunk=5)[0])
    assert outs[0] == outs[1]


@given(st.text(max_size=40))
def test_byte_tokenizer_round_trips_text(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode([tok.BOS, *ids, tok.EOS, tok.PAD]) == text


def test_byte_tokenizer_rejects_out_of_range_ids() -> None:
    with pytest.raises(ConfigError, match="259"):
        ByteTokenizer().decode([65, 259])
    assert ByteTokenizer().decode([0xE2, 0x82]) == "\ufffd"  # truncated UTF-8 never raises
