"""KV pool sizing: CPU budget, CUDA free memory x gpu_memory_utilization, max_model_len capping,
dtype aliases, tokenizer=."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from deepinfer_kit import LLM, EngineConfig, build_engine
from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.engine.runner.kv_sizing import (
    activation_reserve_bytes,
    kv_budget_bytes,
    resolve_dtype,
    size_kv_pool,
)
from deepinfer_kit.errors import CheckpointError, ConfigError
from deepinfer_kit.models.config import ModelConfig
from deepinfer_kit.models.tiny import tiny_hf_config

MiB = 1 << 20


def tiny_config() -> ModelConfig:
    return ModelConfig.from_hf_config(tiny_hf_config())


def _per_block(block_size: int = 16, dtype: torch.dtype = torch.float32) -> int:
    mc = tiny_config()
    return PagedKVCache.bytes_per_block(mc.num_layers, block_size, mc.num_kv_heads, mc.head_dim, dtype)


def test_cpu_budget_sizes_the_pool_and_caps_the_default_max_model_len() -> None:
    mc = tiny_config()
    budget = 40 * _per_block() + 7  # a remainder never makes a partial block
    with pytest.warns(UserWarning, match=rf"max_model_len {mc.max_position_embeddings} .* capped to 640"):
        blocks, length = size_kv_pool(model=mc, block_size=16, dtype=torch.float32, budget_bytes=budget,
                                      budget_source="x", num_blocks=None, max_model_len=None)
    assert (blocks, length) == (40, 640)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert size_kv_pool(model=mc, block_size=16, dtype=torch.float32, budget_bytes=budget,
                            budget_source="x", num_blocks=None, max_model_len=600) == (40, 600)
    with pytest.raises(ConfigError, match="the largest max_model_len that fits is 640"):
        size_kv_pool(model=mc, block_size=16, dtype=torch.float32, budget_bytes=budget,
                     budget_source="x", num_blocks=None, max_model_len=641)
    with pytest.raises(ConfigError, match="holds no KV block"):
        size_kv_pool(model=mc, block_size=16, dtype=torch.float32, budget_bytes=_per_block() - 1,
                     budget_source="x", num_blocks=None, max_model_len=None)


def test_engine_built_on_a_small_cpu_budget_serves_the_capped_length() -> None:
    mb = 1
    expected_blocks = (mb * MiB) // _per_block(8)
    with pytest.warns(UserWarning, match=f"capped to {expected_blocks * 8}"):
        llm = LLM("tiny", kv_cache_memory_mb=mb, block_size=8)
    assert llm.engine.cache.num_blocks == expected_blocks
    with pytest.raises(ConfigError, match="max_model_len"):
        llm.generate("x" * (expected_blocks * 8), None)
    llm.engine.check_idle()


def test_cuda_budget_is_utilisation_of_total_minus_memory_in_use() -> None:
    calls: list[torch.device] = []

    def mem_get_info(device: torch.device) -> tuple[int, int]:
        calls.append(device)
        return 30 * 1024 * MiB, 80 * 1024 * MiB  # 50 GiB already in use (weights, others)

    budget, where = kv_budget_bytes(torch.device("cuda:1"), kv_cache_memory_mb=None,
                                    gpu_memory_utilization=0.9, mem_get_info=mem_get_info,
                                    empty_cache=lambda: None)
    assert budget == int(80 * 1024 * MiB * 0.9) - 50 * 1024 * MiB
    assert calls == [torch.device("cuda:1")] and "gpu_memory_utilization=0.9" in where
    with pytest.raises(ConfigError, match="raise gpu_memory_utilization"):
        kv_budget_bytes(torch.device("cuda"), kv_cache_memory_mb=None, gpu_memory_utilization=0.5,
                        mem_get_info=mem_get_info, empty_cache=lambda: None)
    cpu, where = kv_budget_bytes(torch.device("cpu"), kv_cache_memory_mb=3, gpu_memory_utilization=0.1,
                                 mem_get_info=mem_get_info)
    assert cpu == 3 * MiB and len(calls) == 2 and "kv_cache_memory_mb=3" in where


def _cuda_budget(blocks: int, extra: int, monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    """The CUDA rule's budget on a fake 8 GiB device whose memory in use leaves exactly
    ``blocks`` KV blocks plus ``extra`` bytes under gpu_memory_utilization=0.9; read
    through the default getter (``torch.cuda.mem_get_info``, patched: no tensor moves)."""
    total = 8 * 1024 * MiB
    used = int(total * 0.9) - (blocks * _per_block() + extra)
    seen: list[object] = []

    def fake(device: object = None) -> tuple[int, int]:
        seen.append(device)
        return total - used, total

    monkeypatch.setattr(torch.cuda, "mem_get_info", fake)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: seen.append("empty_cache"))
    budget, where = kv_budget_bytes(torch.device("cuda:0"), kv_cache_memory_mb=None,
                                    gpu_memory_utilization=0.9)
    assert seen == ["empty_cache", torch.device("cuda:0")]
    assert budget == blocks * _per_block() + extra
    assert where == (f"gpu_memory_utilization=0.9 of 8192 MiB with {used >> 20} MiB in use "
                     f"and 0 MiB kept for activations")
    return budget, where


class _Allocator:
    """A fake CUDA device of 80 GiB: 10 GiB of weights, plus the cached (unused) blocks
    of an engine built and dropped earlier in the process until ``empty_cache``."""

    def __init__(self) -> None:
        self.cached = 65 * 1024 * MiB
        self.calls: list[str] = []

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.cached = 0

    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        self.calls.append("mem_get_info")
        total = 80 * 1024 * MiB
        return total - 10 * 1024 * MiB - self.cached, total


def test_a_second_engine_in_one_process_sizes_after_returning_the_cached_pool() -> None:
    alloc = _Allocator()
    budget, _ = kv_budget_bytes(torch.device("cuda"), kv_cache_memory_mb=None,
                                gpu_memory_utilization=0.9, mem_get_info=alloc.mem_get_info,
                                empty_cache=alloc.empty_cache)
    assert alloc.calls == ["empty_cache", "mem_get_info"]
    assert budget == int(80 * 1024 * MiB * 0.9) - 10 * 1024 * MiB
    with pytest.raises(ConfigError, match="leaves no memory"):  # what skipping it would do
        kv_budget_bytes(torch.device("cuda"), kv_cache_memory_mb=None, gpu_memory_utilization=0.9,
                        mem_get_info=_Allocator().mem_get_info, empty_cache=lambda: None)


def test_kv_cache_memory_mb_is_the_cuda_budget_when_given_and_must_fit() -> None:
    def sized(mb: int | None, reserve: int = 0) -> tuple[int, str]:
        alloc = _Allocator()
        return kv_budget_bytes(torch.device("cuda"), kv_cache_memory_mb=mb,
                               gpu_memory_utilization=0.9, reserve_bytes=reserve,
                               mem_get_info=alloc.mem_get_info, empty_cache=alloc.empty_cache)

    assert sized(1024) == (1024 * MiB, "kv_cache_memory_mb=1024")
    headroom = int(80 * 1024 * MiB * 0.9) - 10 * 1024 * MiB
    assert sized(None, reserve=3 * 1024 * MiB)[0] == headroom - 3 * 1024 * MiB
    with pytest.raises(ConfigError, match="kv_cache_memory_mb=70000 exceeds"):
        sized(70000)
    with pytest.raises(ConfigError, match="kv_cache_memory_mb=61000 exceeds"):
        sized(61000, reserve=3 * 1024 * MiB)
    assert sized(61000)[0] == 61000 * MiB


def test_the_activation_reserve_grows_with_the_round_and_the_vocabulary() -> None:
    mc = tiny_config()
    base = activation_reserve_bytes(mc, max_num_seqs=8, max_num_batched_tokens=64, dtype=torch.float32)
    assert base > 256 * MiB
    more_rows = activation_reserve_bytes(mc, max_num_seqs=16, max_num_batched_tokens=64,
                                         dtype=torch.float32)
    assert more_rows - base == 2 * 8 * mc.vocab_size * 4
    assert activation_reserve_bytes(mc, max_num_seqs=8, max_num_batched_tokens=128,
                                    dtype=torch.float32) > base


def test_cuda_budget_caps_the_default_max_model_len_with_both_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    mc = tiny_config()
    budget, where = _cuda_budget(40, 7, monkeypatch)
    with pytest.warns(UserWarning) as caught:
        blocks, length = size_kv_pool(model=mc, block_size=16, dtype=torch.float32, budget_bytes=budget,
                                      budget_source=where, num_blocks=None, max_model_len=None)
    assert (blocks, length) == (40, 640)
    (message,) = [str(w.message) for w in caught]
    assert f"max_model_len {mc.max_position_embeddings} does not fit" in message
    assert "capped to 640" in message and where in message and "40 blocks of 16 tokens" in message


def test_cuda_budget_refuses_an_explicit_length_beyond_it_and_a_pool_without_a_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mc = tiny_config()
    budget, where = _cuda_budget(40, 0, monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert size_kv_pool(model=mc, block_size=16, dtype=torch.float32, budget_bytes=budget,
                            budget_source=where, num_blocks=None, max_model_len=640) == (40, 640)
    with pytest.raises(ConfigError) as err:
        size_kv_pool(model=mc, block_size=16, dtype=torch.float32, budget_bytes=budget,
                     budget_source=where, num_blocks=None, max_model_len=641)
    assert where in str(err.value) and "the largest max_model_len that fits is 640" in str(err.value)
    budget, where = _cuda_budget(0, _per_block() - 1, monkeypatch)  # positive, under one block
    with pytest.raises(ConfigError, match="holds no KV block of 16 tokens") as err:
        size_kv_pool(model=mc, block_size=16, dtype=torch.float32, budget_bytes=budget,
                     budget_source=where, num_blocks=None, max_model_len=None)
    assert where in str(err.value)


@pytest.mark.parametrize("value", [0, 1.5, -0.1, "0.9", True])
def test_gpu_memory_utilization_is_validated(value: object) -> None:
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=value)  # type: ignore[arg-type]


def test_dtype_auto_and_aliases() -> None:
    assert resolve_dtype("auto", {"torch_dtype": "bfloat16"}) == "bfloat16"
    assert resolve_dtype("auto", {"dtype": "float16"}) == "float16"
    assert resolve_dtype("auto", None) == "float32"
    assert resolve_dtype("half", None) == "float16" and resolve_dtype("float", None) == "float32"
    with pytest.raises(ConfigError, match="torch_dtype 'int8'"):
        resolve_dtype("auto", {"torch_dtype": "int8"})
    engine = build_engine(EngineConfig(dtype="half", num_blocks=16, max_model_len=256))
    assert engine.runner.kv_cache.dtype == torch.float16
    with pytest.raises(ConfigError, match="dtype"):
        EngineConfig(dtype="float64")


def test_dtype_auto_is_bfloat16_on_cuda_for_a_float32_checkpoint_and_its_own_on_cpu(tmp_path: Path) -> None:
    import json
    import shutil

    from deepinfer_kit.engine.runner.pool import model_dtype
    from deepinfer_kit.models.embedded import embedded_checkpoint

    assert resolve_dtype("auto", {"torch_dtype": "float32"}, "cuda") == "bfloat16"
    assert resolve_dtype("auto", {}, "cuda") == "bfloat16"
    assert resolve_dtype("auto", {"torch_dtype": "float16"}, "cuda") == "float16"
    assert resolve_dtype("auto", {"torch_dtype": "float32"}, "cpu") == "float32"
    assert resolve_dtype("float32", {"torch_dtype": "float32"}, "cuda") == "float32"  # explicit wins
    assert resolve_dtype("auto", None, "cuda") == "float32"  # the embedded models
    shutil.copy(Path(embedded_checkpoint("tiny-words")) / "config.json", tmp_path / "config.json")
    for written, cpu, cuda in (("float32", torch.float32, torch.bfloat16),
                               ("bfloat16", torch.bfloat16, torch.bfloat16),
                               ("float16", torch.float16, torch.float16)):
        raw = json.loads((tmp_path / "config.json").read_text())
        raw["torch_dtype"] = written
        (tmp_path / "config.json").write_text(json.dumps(raw))
        config = EngineConfig(model=str(tmp_path))
        assert config.dtype == "auto"
        assert model_dtype(config, torch.device("cpu")) == cpu
        assert model_dtype(config, torch.device("cuda")) == cuda


def test_tokenizer_folder_must_hold_a_tokenizer(tmp_path: object) -> None:
    with pytest.raises(CheckpointError, match="has no tokenizer.json"):
        LLM("tiny", num_blocks=16, max_model_len=64, tokenizer=str(tmp_path))
