"""The deepinfer-kit command: generate and trace on the embedded model."""

from __future__ import annotations

import pytest

from deepinfer_kit.cli import main


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


def test_bad_input_exits_2_with_the_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--max-tokens", "0"]) == 2
    assert "max_tokens must be >= 1, got 0" in capsys.readouterr().err
