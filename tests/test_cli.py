"""The deepinfer-kit command: generate and trace on the embedded model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import save_file

from deepinfer_kit.cli import main
from deepinfer_kit.models.config import ModelConfig
from deepinfer_kit.models.tiny import tiny_hf_config, tiny_hf_weights


def test_generate_prints_generations_and_a_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--prompt", "hello", "--prompt", "world", "--max-tokens", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[req-0] 'hello' -> ") and "(5 tokens, length)" in out[0]
    assert out[1].startswith("[req-1] 'world' -> ")
    assert out[-1].startswith("requests=2 output_tokens=10 ")
    assert "tokens/s=" in out[-1] and "prefix_hit_rate=" in out[-1]


def test_no_arguments_runs_the_default_generation(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("requests=4 output_tokens=96 ")


def test_trace_follows_one_request(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["trace", "--prompt", "first prompt", "--prompt", "second", "--request", "1", "--max-tokens", "3"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "following req-1: 'second'" in out
    assert "prefill positions [0, 6)" in out
    assert out.count("decode  positions") == 2
    assert "finished: req-1" in out


def test_trace_shows_drafted_and_accepted_tokens_with_speculation(
    capsys: pytest.CaptureFixture[str],
) -> None:
    prompt = "abc" * 8
    args = ["trace", "--num-draft", "4", "--prompt", prompt, "--max-tokens", "16"]
    assert main(args) == 0
    spec_out = capsys.readouterr().out
    assert "drafted=" in spec_out and "accepted=" in spec_out
    assert main(["trace", "--prompt", prompt, "--max-tokens", "16"]) == 0
    plain_out = capsys.readouterr().out
    assert "drafted=" not in plain_out

    def sampled(out: str) -> list[str]:
        return [t for line in out.splitlines() if "sampled=[" in line
                for t in line.split("sampled=[")[1].split("]")[0].split(", ") if t]

    assert sampled(spec_out) == sampled(plain_out)  # greedy: the same tokens either way


@pytest.mark.parametrize("flags", [["--drafter", "self", "--draft-layers", "1"],
                                   ["--drafter", "draft_model", "--draft-model", "tiny"]])
def test_trace_with_a_model_drafter(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    prompt = "abc" * 8
    assert main(["trace", "--num-draft", "3", *flags, "--prompt", prompt, "--max-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert "drafted=" in out and "accepted=" in out


def test_a_model_drafter_without_its_field_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--num-draft", "3", "--drafter", "self"]) == 2
    assert "speculative.draft_layers" in capsys.readouterr().err


def test_bad_input_exits_2_with_the_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--max-tokens", "0"]) == 2
    assert "max_tokens must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("device", ["meta", "bogus", "cuda:abc"])
def test_bad_device_exits_2_naming_it(device: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--device", device, "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: device ") and repr(device) in err and "Traceback" not in err, err


@pytest.mark.parametrize("how", ["truncated", "garbage-header"])
def test_corrupt_checkpoint_exits_2_naming_the_file(
    how: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tiny_hf_config()
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = tiny_hf_weights(ModelConfig.from_hf_config(config), seed=0)
    file = tmp_path / "model.safetensors"
    save_file(weights, str(file))
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if how == "truncated" else b"\xff" * 64 + data[64:])
    assert main(["generate", "--model", str(tmp_path), "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(file) in err and "Traceback" not in err, err


def test_trace_of_a_missing_prompt_index_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "--prompt", "only one", "--request", "1", "--max-tokens", "2"]) == 2
    assert capsys.readouterr().err == "error: --request must be in [0, 1), got 1\n"
