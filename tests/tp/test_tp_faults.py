"""A broken tensor-parallel group is an error, not a hang: a rank killed mid-round, a
collective failing on one rank, a rank raising while its peers wait, a stalled rank; the
host raises EngineDeadError within the collective timeout and no rank process is left."""

from __future__ import annotations

import os
import time

import pytest

from deepinfer_kit import EngineDeadError, SamplingParams, build_engine
from comm_faults import FaultOnRank

POOL = {"num_blocks": 32, "block_size": 8, "max_model_len": 64, "max_num_seqs": 4,
        "max_num_batched_tokens": 32}
# Collectives per forward of the tiny model at T = 2: an embedding all-reduce, one per
# o_proj (2 layers), the logits gather. Number 9 falls in the second round.
MID_ROUND = 9


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _serve_until_dead(fault: str, timeout: float) -> float:
    engine = build_engine(worker="process", tensor_parallel=2, collective_timeout=timeout,
                          overlap=False, wrap_comm=FaultOnRank(1, fault, MID_ROUND), **POOL)
    pids = list(engine.runner.pids)  # type: ignore[attr-defined]
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i, 9, 11, 13], SamplingParams(max_tokens=8))
    start = time.monotonic()
    with pytest.raises(EngineDeadError):
        for _ in range(50):
            engine.step()
    elapsed = time.monotonic() - start
    engine.close()
    assert all(_gone(pid) for pid in pids), "a rank process was left behind"
    return elapsed


@pytest.mark.parametrize("fault", ["kill", "collective"])
def test_a_rank_that_dies_or_fails_a_collective_ends_the_engine_at_once(fault: str) -> None:
    """Both surface as soon as the host hears of them: well inside the 10 s timeout."""
    assert _serve_until_dead(fault, timeout=10.0) < 10.0


@pytest.mark.parametrize("fault", ["raise", pytest.param("stall", marks=pytest.mark.slow)])
def test_a_rank_that_raises_or_stalls_leaves_its_peers_to_time_out(fault: str) -> None:
    """The peers wait inside the collective until the timeout, then the group ends: the
    host raises once that timeout has passed (plus the time to reap the ranks)."""
    timeout = 3.0
    elapsed = _serve_until_dead(fault, timeout=timeout)
    assert timeout * 0.9 <= elapsed < timeout + 30.0  # bounded: no hang
