"""The generate command's parallel flags reach the EngineConfig (vLLM's spelling)."""

from __future__ import annotations

import pytest

from deepinfer_kit.cli import build_parser, engine_config, main


@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "-tp"])
def test_tensor_parallel_size_and_timeout_reach_the_config(flag: str) -> None:
    args = build_parser().parse_args(["generate", "--model", "tiny", "--worker", "process", flag, "2",
                                      "--collective-timeout", "12.5"])
    config = engine_config(args)
    assert (config.tensor_parallel, config.collective_timeout, config.worker) == (2, 12.5, "process")


def test_tensor_parallel_without_a_multi_process_worker_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", "tiny", "--tensor-parallel-size", "2"]) == 2
    assert "set worker='process'" in capsys.readouterr().err
