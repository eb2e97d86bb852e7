"""KV tiers on launched ranks (each runs the whole engine on its shard): each rank's tiers
hold its own heads, in files of their own, and the ranks agree on what a request loads, so
they schedule alike — also when one rank's files are gone."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp

from deepinfer_kit import build_engine
from tier_ranks import POOL, launched_tiers, prompts, serve


def _run(tmp_path: Path, lose_files_on: int | None) -> list[Any]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ctx = mp.get_context("spawn")
    out: Any = ctx.Queue()
    procs = [ctx.Process(target=launched_tiers, args=(r, 2, port, str(tmp_path), lose_files_on, out))
             for r in range(2)]
    for p in procs:
        p.start()
    got = sorted((out.get(timeout=300) for _ in procs), key=lambda g: g[0])
    for p in procs:
        p.join(timeout=60)
    return got


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    engine = build_engine(**POOL)
    want = {**serve(engine, prompts(), "a"), **serve(engine, prompts(), "b")}
    engine.close()
    return want


def test_two_launched_ranks_with_tiers_give_one_engines_tokens(tmp_path: Path, reference: dict[str, list[int]]) -> None:
    got = _run(tmp_path, None)
    for rank, first, second, loaded, reloaded, failed, files in got:
        assert {**first, **second} == reference, f"rank {rank}"
        assert loaded > 0 and reloaded > 0 and failed == 0
    assert got[0][3:5] == got[1][3:5]  # they loaded the same blocks
    # each rank's heads in a folder of its own (two KV heads over two ranks)
    assert got[0][6] == ["heads-0-1-of-2", "heads-1-2-of-2"]


def test_ranks_agree_when_one_rank_lost_its_files(tmp_path: Path, reference: dict[str, list[int]]) -> None:
    got = _run(tmp_path, 1)
    for rank, first, second, loaded, reloaded, failed, files in got:
        assert {**first, **second} == reference, f"rank {rank}"
    # rank 1 found its files gone (rank 0 did not): both loaded the same, what rank 1 held
    assert got[1][5] > 0 and got[0][5] == 0
    assert got[0][4] == got[1][4]


def test_a_load_failed_on_one_rank_fails_on_every_rank() -> None:
    from tier_ranks import agreed_loads

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ctx = mp.get_context("spawn")
    out: Any = ctx.Queue()
    procs = [ctx.Process(target=agreed_loads, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert got[0] == [([1], []), ([2], [7, 9]), None]  # rank 0 hears of rank 1's failed loads
    assert got[1] == [([1], []), ([2], [7, 9]), None]  # saves stay each rank's own
