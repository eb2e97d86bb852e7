"""The communication layer: collectives over gloo give every rank the same values, a
collective a peer never joins fails with CollectiveError within its timeout, the launcher
environment is read strictly, and the timing wrapper counts what passes through it."""

from __future__ import annotations

import socket
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from deepinfer_kit.comm import LocalCommunicator, TimedCommunicator, TorchCommunicator, world_from_env
from deepinfer_kit.errors import ConfigError
from comm_ranks import collectives
from thread_comm import run_ranks, thread_group


def test_gloo_collectives_and_a_collective_nobody_joins() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ctx = mp.get_context("spawn")
    out: Any = ctx.Queue()
    procs = [ctx.Process(target=collectives, args=(r, 2, f"tcp://127.0.0.1:{port}", out)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted((out.get(timeout=120) for _ in procs), key=lambda g: g["rank"])
    for p in procs:
        p.join(timeout=60)
    for r, g in enumerate(got):
        assert (g["rank"], g["world"]) == (r, 2)
        assert g["reduce"] == [3.0, 3.0, 3.0]
        assert g["gather"] == [[0.0, 1.0], [0.0, 1.0]]
        assert g["broadcast"] == [1.0, 1.0]
    assert "all_reduce" in got[0]["lonely"] and "rank 0 of 2" in got[0]["lonely"]


def test_local_communicator_is_the_identity() -> None:
    comm = LocalCommunicator()
    x = torch.arange(4.0)
    assert comm.all_reduce(x) is x and comm.all_gather(x, 0) is x and comm.broadcast(x, 0) is x
    assert (comm.rank, comm.world_size) == (0, 1)


def test_the_timed_wrapper_counts_calls_bytes_and_time() -> None:
    timed = [TimedCommunicator(c) for c in thread_group(2)]

    def work(comm: TimedCommunicator) -> Any:
        comm.all_reduce(torch.ones(4))
        comm.all_gather(torch.ones(2, 3), 0)
        comm.barrier()
        return comm.take(), comm.take()

    for first, second in run_ranks([lambda c=c: work(c) for c in timed]):
        assert (first.calls, first.bytes) == (3, 4 * 4 + 6 * 4) and first.seconds >= 0
        assert (second.calls, second.bytes, second.seconds) == (0, 0, 0.0)


@pytest.mark.parametrize(("env", "match"), [
    ({"MASTER_ADDR": "h"}, "but not"),
    ({"MASTER_ADDR": "h", "MASTER_PORT": "1", "WORLD_SIZE": "two", "RANK": "0"}, "WORLD_SIZE"),
    ({"MASTER_ADDR": "h", "MASTER_PORT": "1", "WORLD_SIZE": "2", "RANK": "2"}, "RANK"),
])
def test_a_partial_or_bad_launcher_environment_is_a_config_error(env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        world_from_env(env)


def test_the_launcher_environment_is_read() -> None:
    assert world_from_env({}) is None
    spec = world_from_env({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "4",
                           "RANK": "3", "LOCAL_RANK": "1"})
    assert spec is not None and (spec.rank, spec.world_size, spec.init_method, spec.local_rank) == (
        3, 4, "env://", 1)


def test_a_timeout_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="timeout"):
        TorchCommunicator(None, timeout=0)
