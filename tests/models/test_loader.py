"""The checkpoint loader: shards, dtype, tokenizer choice, and a clear error for each bad folder."""

from __future__ import annotations

import json
import pickle
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from paged_driver import PagedDriver
from safetensors.torch import save_file

from deepinfer_kit.engine.runner.assemble import load_model, moe_layer_factory
from deepinfer_kit.errors import CheckpointError, ConfigError
from deepinfer_kit.models import loader
from deepinfer_kit.models.config import ModelConfig
from deepinfer_kit.models.protocols import SparseMLP
from deepinfer_kit.models.loader import build_model
from deepinfer_kit.models.tiny import tiny_hf_config, tiny_hf_weights
from deepinfer_kit.models.tokenizer import ByteTokenizer, HFTokenizer, missing_tokenizer_reason
from deepinfer_kit.models.weights import SafetensorsWeights, TrackedWeights, safetensors_files


def write_checkpoint(folder: Path, config: dict[str, Any], weights: dict[str, torch.Tensor], *,
                     shards: int = 1) -> None:
    """``config.json`` plus ``weights`` in ``shards`` safetensors files (indexed when > 1)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    names = sorted(weights)
    if shards == 1:
        save_file({n: weights[n].contiguous() for n in names}, str(folder / "model.safetensors"))
        return
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({n: weights[n].contiguous() for n in part}, str(folder / file))
        weight_map.update({n: file for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def tiny_checkpoint(folder: Path, **overrides: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    config = tiny_hf_config() | overrides
    weights = tiny_hf_weights(ModelConfig.from_hf_config(config), seed=3)
    return config, weights


def _logits(model: Any, prompt: list[int]) -> torch.Tensor:
    driver = PagedDriver(model)
    return driver.forward([(driver.new_seq(prompt, 0), len(prompt))], all_logits=True)


def test_sharded_folder_loads_like_a_single_file(tmp_path: Path) -> None:
    config, weights = tiny_checkpoint(tmp_path)
    write_checkpoint(tmp_path / "one", config, weights)
    write_checkpoint(tmp_path / "three", config, weights, shards=3)
    assert len(list((tmp_path / "three").glob("*.safetensors"))) == 3
    prompt = [5, 17, 250, 3, 99]
    one, three = load_model(tmp_path / "one"), load_model(tmp_path / "three")
    torch.testing.assert_close(_logits(one.model, prompt), _logits(three.model, prompt), rtol=0, atol=0)
    assert isinstance(one.tokenizer, ByteTokenizer)


def test_unindexed_shards_are_all_read(tmp_path: Path) -> None:
    config, weights = tiny_checkpoint(tmp_path)
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, config, weights, shards=2)
    (folder / "model.safetensors.index.json").unlink()
    located = safetensors_files(folder)
    assert set(located) == set(weights)
    assert {p.name for p in located.values()} == {p.name for p in folder.glob("*.safetensors")}
    with SafetensorsWeights(folder) as found:
        tracked = TrackedWeights(found)
        model = build_model(
            ModelConfig.from_pretrained(folder), tracked, sparse_mlp_factory=moe_layer_factory("ref")
        )
        assert tracked.unread() == []  # the model took every tensor of both shards
        for name, tensor in weights.items():
            assert torch.equal(found[name], tensor), name
    write_checkpoint(tmp_path / "one", config, weights)
    prompt = [5, 17, 250, 3, 99]
    torch.testing.assert_close(_logits(model, prompt), _logits(load_model(tmp_path / "one").model, prompt),
                               rtol=0, atol=0)


@pytest.mark.parametrize("name", ["model.layers.1.self_attn.k_proj.weight",
                                  "model.layers.0.mlp.experts.5.up_proj.weight", "model.norm.weight"])
def test_missing_tensor_is_named(tmp_path: Path, name: str) -> None:
    config, weights = tiny_checkpoint(tmp_path)
    del weights[name]
    write_checkpoint(tmp_path / "ckpt", config, weights)
    with pytest.raises(CheckpointError, match=f"{re.escape(name)}.*missing|missing.*{re.escape(name)}"):
        load_model(tmp_path / "ckpt")


@pytest.mark.parametrize("name", ["model.embed_tokens.weight", "model.layers.0.self_attn.q_norm.weight",
                                  "model.layers.1.mlp.gate.weight", "lm_head.weight"])
def test_misshaped_tensor_is_named_with_both_shapes(tmp_path: Path, name: str) -> None:
    config, weights = tiny_checkpoint(tmp_path)
    good = tuple(weights[name].shape)
    weights[name] = torch.zeros(*(d + 1 for d in good))
    write_checkpoint(tmp_path / "ckpt", config, weights)
    with pytest.raises(CheckpointError) as err:
        load_model(tmp_path / "ckpt")
    message = str(err.value)
    assert name in message and str(list(good)).strip("[]") in message.replace("(", "[").replace(")", "]")


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.extra.weight", "model.layers.7.input_layernorm.weight",
                                  "model.layers.1.mlp.experts.8.up_proj.weight", "head.bias"])
def test_unexpected_tensor_is_named(tmp_path: Path, name: str) -> None:
    config, weights = tiny_checkpoint(tmp_path)
    weights[name] = torch.zeros(4)
    write_checkpoint(tmp_path / "ckpt", config, weights)
    with pytest.raises(CheckpointError, match="unexpected") as err:
        load_model(tmp_path / "ckpt")
    assert name in str(err.value)


def test_tied_checkpoint_may_carry_lm_head(tmp_path: Path) -> None:
    config, weights = tiny_checkpoint(tmp_path, tie_word_embeddings=True)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    write_checkpoint(tmp_path / "ckpt", config, weights)
    assert load_model(tmp_path / "ckpt").model.lm_head is None


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    config, weights = tiny_checkpoint(tmp_path)
    write_checkpoint(tmp_path / "ckpt", config | {"architectures": ["GPT2LMHeadModel"]}, weights)
    with pytest.raises(ConfigError, match="GPT2LMHeadModel"):
        load_model(tmp_path / "ckpt")


class _Boobytrap:
    """Unpickling this writes a marker file: proof that a pickle was loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (self.marker, "unpickled"))


def test_pickle_only_folder_is_refused_unread(tmp_path: Path) -> None:
    config, _ = tiny_checkpoint(tmp_path)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "marker"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(_Boobytrap(marker)))
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*never loaded"):
        load_model(folder)
    assert not marker.exists()


def test_index_naming_a_missing_shard_is_refused(tmp_path: Path) -> None:
    config, weights = tiny_checkpoint(tmp_path)
    write_checkpoint(tmp_path / "ckpt", config, weights, shards=2)
    (tmp_path / "ckpt" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors"):
        load_model(tmp_path / "ckpt")


def test_tensor_in_two_shards_is_refused(tmp_path: Path) -> None:
    config, weights = tiny_checkpoint(tmp_path)
    write_checkpoint(tmp_path / "ckpt", config, weights)
    save_file({"model.norm.weight": weights["model.norm.weight"]}, str(tmp_path / "ckpt" / "extra.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*both"):
        load_model(tmp_path / "ckpt")


def test_folder_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(tmp_path)


def test_bad_dtype_is_refused(tmp_path: Path) -> None:
    config, weights = tiny_checkpoint(tmp_path)
    write_checkpoint(tmp_path / "ckpt", config, weights)
    with pytest.raises(ConfigError, match="dtype"):
        load_model(tmp_path / "ckpt", dtype=torch.int8)


def test_float16_weights_convert_to_the_requested_dtype(tmp_path: Path) -> None:
    config, weights = tiny_checkpoint(tmp_path)
    write_checkpoint(tmp_path / "ckpt", config, {k: v.half() for k, v in weights.items()})
    model = load_model(tmp_path / "ckpt", dtype=torch.float32).model
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "gate.weight" not in n)
    torch.testing.assert_close(model.embed_tokens, weights["model.embed_tokens.weight"].half().float())


def test_tokenizer_json_is_used_when_present(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    config, weights = tiny_checkpoint(tmp_path, eos_token_id=[4, 9])
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, config, weights)
    vocab = {"<unk>": 0, "hello": 1, "world": 2, "again": 3, "</s>": 4}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.add_special_tokens(["</s>"])
    backend.save(str(folder / "tokenizer.json"))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 11]}))
    loaded = load_model(folder)
    assert isinstance(loaded.tokenizer, HFTokenizer)
    assert loaded.config.eos_token_ids == (4, 9, 11)
    assert loaded.tokenizer.eos_token_id == 4
    assert loaded.tokenizer.encode("hello world again") == [1, 2, 3]
    assert loaded.tokenizer.decode([1, 4, 2]) == "hello world"
    assert loaded.tokenizer.vocab_size == 5


def test_sparse_checkpoint_without_a_factory_is_refused(tmp_path: Path) -> None:
    config, weights = tiny_checkpoint(tmp_path)
    write_checkpoint(tmp_path / "ckpt", config, weights)
    with pytest.raises(ConfigError, match="sparse_mlp_factory is required"):
        loader.load_model(tmp_path / "ckpt")
    with pytest.raises(ConfigError, match="sparse_mlp_factory is required"):
        loader.build_tiny_model(sparse_mlp_factory=None)  # type: ignore[arg-type]


def test_the_injected_factory_builds_every_sparse_layer(tmp_path: Path) -> None:
    config, weights = tiny_checkpoint(tmp_path)
    write_checkpoint(tmp_path / "ckpt", config, weights)
    default = moe_layer_factory("ref")
    built: list[int] = []

    def counting(cfg: ModelConfig, layer: int, /, *, dtype: torch.dtype,
                 device: str | torch.device) -> SparseMLP:
        built.append(layer)
        return default(cfg, layer, dtype=dtype, device=device)

    ours = loader.load_model(tmp_path / "ckpt", sparse_mlp_factory=counting)
    assert built == list(ours.config.sparse_layers)
    prompt = [5, 17, 250, 3, 99]
    torch.testing.assert_close(_logits(ours.model, prompt),
                               _logits(load_model(tmp_path / "ckpt", moe_impl="ref").model, prompt),
                               rtol=0, atol=0)


def _corrupt(file: Path, how: str) -> None:
    data = file.read_bytes()
    if how == "truncated":
        file.write_bytes(data[: len(data) // 2])
    else:  # a header length that points past the end, then bytes that are not JSON
        file.write_bytes((16).to_bytes(8, "little") + b"\x00garbage{{{not json" + data[40:])


@pytest.mark.parametrize("how", ["truncated", "garbage-header"])
def test_corrupt_single_file_checkpoint_is_named(tmp_path: Path, how: str) -> None:
    config, weights = tiny_checkpoint(tmp_path)
    write_checkpoint(tmp_path / "ckpt", config, weights)
    file = tmp_path / "ckpt" / "model.safetensors"
    _corrupt(file, how)
    with pytest.raises(CheckpointError) as err:
        load_model(tmp_path / "ckpt")
    assert str(file) in str(err.value)


@pytest.mark.parametrize("how", ["truncated", "garbage-header"])
def test_corrupt_indexed_shard_names_the_file_and_the_tensor(tmp_path: Path, how: str) -> None:
    config, weights = tiny_checkpoint(tmp_path)
    write_checkpoint(tmp_path / "ckpt", config, weights, shards=2)
    file = tmp_path / "ckpt" / "model-00002-of-00002.safetensors"
    _corrupt(file, how)
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    in_shard = {n for n, f in index["weight_map"].items() if f == file.name}
    with pytest.raises(CheckpointError) as err:
        load_model(tmp_path / "ckpt")
    message = str(err.value)
    assert str(file) in message
    named = re.search(r"tensor '([^']+)'", message)
    assert named is not None and named.group(1) in in_shard, message


def test_tokenizers_is_required_not_silently_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``tokenizers`` is a declared dependency: a checkpoint's tokenizer.json is always read
    with it, and a broken install fails loudly instead of falling back to bytes."""
    config, weights = tiny_checkpoint(tmp_path, vocab_size=300)
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, config, weights)
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` raises ImportError
    with pytest.raises(ImportError):
        load_model(folder)


def test_text_prompt_error_names_the_missing_tokenizer_json(tmp_path: Path) -> None:
    from deepinfer_kit import SamplingParams, build_engine

    config, weights = tiny_checkpoint(tmp_path, vocab_size=300)
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, config, weights)
    assert isinstance(load_model(folder).tokenizer, ByteTokenizer)
    engine = build_engine(model=str(folder), num_blocks=64, max_model_len=256)
    assert engine.tokenizer is None  # vocab 300: the byte tokenizer cannot stand in
    with pytest.raises(ConfigError, match="has no tokenizer.json"):
        engine.add_request(None, "hello", SamplingParams(max_tokens=2))
    assert "not read from a checkpoint folder" in missing_tokenizer_reason(None)
    engine.add_request(None, [1, 2, 3], SamplingParams(max_tokens=2))  # token ids still work
    engine.run()
    engine.check_idle()
