"""The trained embedded model ``"tiny-words"``: shipped file, loading, words, reuse, drafts.

The shipped checkpoint's checksum is the one docs/models.md states; it loads through the
normal Hugging Face folder path and gives the training model's logits; greedy output on the
CLI's built-in prompts is reproducible, mostly printable ASCII and made of words of the
training text; the shared prompts hit the prefix cache; n-gram drafts get accepted.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from deepinfer_kit import SamplingParams, build_engine
from deepinfer_kit.cli import DEFAULT_PROMPTS
from deepinfer_kit.engine.engine import Engine
from deepinfer_kit.engine.trace import StepTrace
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.embedded import TINY_WORDS_SHA256, embedded_checkpoint, file_sha256
from deepinfer_kit.models.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)  # the CLI default


def training_script() -> ModuleType:
    """``scripts/train_embedded.py`` as a module (it is not part of the package)."""
    if "train_embedded" in sys.modules:
        return sys.modules["train_embedded"]
    spec = importlib.util.spec_from_file_location("train_embedded", ROOT / "scripts" / "train_embedded.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_embedded"] = module
    spec.loader.exec_module(module)
    return module


def run_prompts(engine: Engine, prompts: list[str], params: SamplingParams) -> list[list[int]]:
    """Greedy token ids of every prompt, all added before the engine runs."""
    ids = [engine.add_request(None, p, params) for p in prompts]
    outs = {o.request_id: o for o in engine.run()}
    engine.check_idle()
    return [list(outs[i].outputs[0].token_ids) for i in ids]


@pytest.fixture(scope="module")
def outputs() -> list[list[int]]:
    return run_prompts(build_engine(model="tiny-words"), list(DEFAULT_PROMPTS), GREEDY)


def test_shipped_file_checksum_is_the_documented_one() -> None:
    path = embedded_checkpoint("tiny-words") / "model.safetensors"
    assert file_sha256(path) == TINY_WORDS_SHA256
    assert TINY_WORDS_SHA256 in (ROOT / "docs" / "models.md").read_text()
    assert path.stat().st_size < 4 << 20


def test_shipped_weights_record_the_corpus_snapshot_and_hyperparameters() -> None:
    script = training_script()
    path = embedded_checkpoint("tiny-words") / "model.safetensors"
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata()
    assert meta["corpus_sha256"] == script.load_corpus()[1]
    assert json.loads(meta["hyperparameters"]) == script.FULL


def test_shipped_config_is_the_training_config() -> None:
    shipped = json.loads((embedded_checkpoint("tiny-words") / "config.json").read_text())
    assert shipped == training_script().HF_CONFIG


def test_transformers_reads_the_shipped_folder_as_a_qwen3_moe_checkpoint() -> None:
    """The tensor names are Hugging Face's: transformers loads the folder and gives the
    engine model's logits."""
    transformers = pytest.importorskip("transformers")
    from paged_driver import PagedDriver

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(embedded_checkpoint("tiny-words")), dtype=torch.float32).eval()
    prompt = ByteTokenizer().encode(DEFAULT_PROMPTS[3])
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    model = build_engine(model="tiny-words").runner.model
    driver = PagedDriver(model, num_blocks=64, block_size=16)
    got = driver.forward([(driver.new_seq(prompt, 1), len(prompt))], all_logits=True)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


def test_unknown_embedded_name_is_refused() -> None:
    with pytest.raises(ConfigError, match="embedded checkpoint.*'tiny'"):
        embedded_checkpoint("tiny")


def test_loader_gives_the_training_models_logits() -> None:
    """The shipped fp16 tensors in the training forward (float32) and in the engine's model
    loaded from the folder agree on every position of a prompt."""
    from safetensors.torch import load_file

    from paged_driver import PagedDriver

    script = training_script()
    folder = embedded_checkpoint("tiny-words")
    weights = {n: t.float() for n, t in load_file(str(folder / "model.safetensors")).items()}
    trained = script.WordsModel(script.HF_CONFIG, torch.Generator().manual_seed(0))
    script.load_hf_weights(trained, weights)
    prompt = ByteTokenizer().encode(DEFAULT_PROMPTS[0] + " " + DEFAULT_PROMPTS[2])
    with torch.no_grad():
        expected, _ = trained(torch.tensor([prompt]))
    engine = build_engine(model="tiny-words")
    model = engine.runner.model
    driver = PagedDriver(model, num_blocks=64, block_size=16)
    got = driver.forward([(driver.new_seq(prompt, 1), len(prompt))], all_logits=True)
    torch.testing.assert_close(got, expected[0], atol=2e-4, rtol=1e-4)


def test_greedy_output_is_reproducible(outputs: list[list[int]]) -> None:
    again = run_prompts(build_engine(model="tiny-words"), list(DEFAULT_PROMPTS), GREEDY)
    assert again == outputs


def test_greedy_output_is_words_of_the_training_text(outputs: list[list[int]]) -> None:
    """>= 95% of the output bytes are printable ASCII, and >= 60% of its words of 3+
    letters occur in the training corpus (the random "tiny" gives ~41% and 0%)."""
    corpus_words = set(re.findall(r"[a-z]{3,}", (ROOT / "scripts" / "embedded_corpus.txt").read_text().lower()))
    data = bytes(t for out in outputs for t in out if t < 256)
    printable = sum(32 <= b < 127 or b == 10 for b in data) / len(data)
    words = [w for out in outputs for w in re.findall(r"[a-z]{3,}", ByteTokenizer().decode(out).lower())]
    known = sum(w in corpus_words for w in words) / max(1, len(words))
    assert printable >= 0.95 and len(words) >= 8 and known >= 0.6, (printable, known, words)


def test_shared_prompts_hit_the_prefix_cache() -> None:
    """The first two built-in prompts share 56 bytes: the second, admitted after the first
    has been prefilled, reuses its full blocks."""
    engine = build_engine(model="tiny-words", block_size=16)
    first, second = DEFAULT_PROMPTS[0], DEFAULT_PROMPTS[1]
    run_prompts(engine, [first], GREEDY)
    before = engine.num_cached_prompt_tokens
    run_prompts(engine, [second], GREEDY)
    shared = len(re.match(r"The paged KV cache stores each request's keys and values ", second)[0])  # type: ignore[index]
    assert before == 0 and engine.num_cached_prompt_tokens == shared // 16 * 16 > 0


def test_ngram_drafts_are_accepted(outputs: list[list[int]]) -> None:
    """Greedy n-gram speculation gives the plain greedy tokens with a mean acceptance length
    (tokens committed per verify round of a request) above 1.5 (measured 1.72; drafts that
    never match, each byte shifted by one, give 1.03)."""
    traces: list[StepTrace] = []
    engine = build_engine(model="tiny-words", speculative={"drafter": "ngram", "num_draft": 4}, trace=traces.append)
    assert run_prompts(engine, list(DEFAULT_PROMPTS), GREEDY) == outputs
    rounds = [c for t in traces for c in t.chunks if c.num_drafted]
    accepted = sum(c.num_accepted for c in rounds)
    assert rounds and (len(rounds) + accepted) / len(rounds) > 1.5
