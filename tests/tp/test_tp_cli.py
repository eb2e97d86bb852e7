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


def test_tensor_parallel_alone_starts_worker_processes_and_launched_is_kept() -> None:
    """As vLLM's ``-tp 2``: more than one rank runs one worker process per rank, unless the
    ranks come from a launcher (``--worker launched``)."""
    config = engine_config(build_parser().parse_args(["generate", "--model", "tiny", "-tp", "2"]))
    assert (config.tensor_parallel, config.worker) == (2, "process")
    launched = build_parser().parse_args(["generate", "--model", "tiny", "-tp", "2", "--worker", "launched"])
    assert engine_config(launched).worker == "launched"
    assert engine_config(build_parser().parse_args(["generate", "--model", "tiny"])).worker == "inline"


def test_more_ranks_on_a_gpu_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", "tiny", "-tp", "2", "--device", "cuda"]) == 2
    assert "tensor_parallel=2 runs on CPU ranks" in capsys.readouterr().err
