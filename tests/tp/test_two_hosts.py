"""Two "hosts" on loopback: two torchrun launches with --nnodes 2, one rank each, join one
tensor-parallel group from the standard environment (MASTER_ADDR, MASTER_PORT, WORLD_SIZE,
RANK) and print the single-process engine's text."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from deepinfer_kit.cli import main

pytestmark = pytest.mark.slow  # two launchers, each importing torch and joining over TCP

ARGS = ["generate", "--model", "tiny", "--prompt", "two hosts", "--prompt", "one model",
        "--max-tokens", "6", "--temperature", "0"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def test_two_launches_with_nnodes_2_print_the_single_process_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(ARGS) == 0
    want = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    hosts = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
         "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
         "-m", "deepinfer_kit.cli", *ARGS, "--worker", "launched", "--tensor-parallel-size", "2",
         "--collective-timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for node in (0, 1)]
    try:
        outs = [h.communicate(timeout=300) for h in hosts]
    finally:
        for h in hosts:
            h.kill()
    for h, (out, err) in zip(hosts, outs):
        assert h.returncode == 0, err[-2000:]
        assert [line for line in out.splitlines() if line.startswith("[")] == want
