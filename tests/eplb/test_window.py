"""LoadWindow: the ring keeps the last W steps; steps() returns them oldest first and total()
their sum, locally and over gloo ranks."""

from __future__ import annotations

import socket
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer_kit.eplb.window import LoadWindow
from deepinfer_kit.errors import ConfigError


@pytest.mark.parametrize("seed", range(5))
def test_total_is_the_sum_of_the_last_w_steps(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    window = LoadWindow(3, 5, window=4)
    steps = [torch.randint(0, 50, (3, 5), generator=gen) for _ in range(int(torch.randint(1, 12, (1,), generator=gen)))]
    for i, counts in enumerate(steps):
        window.record(counts.to(torch.int32))
        assert torch.equal(window.total(), torch.stack(steps[max(0, i - 3) : i + 1]).sum(0))
    assert window.num_recorded == len(steps)
    window.reset()
    assert window.num_recorded == 0 and int(window.total().sum()) == 0


@pytest.mark.parametrize("seed", range(5))
def test_steps_are_the_recorded_steps_oldest_first(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    window = LoadWindow(3, 5, window=4)
    assert tuple(window.steps().shape) == (0, 3, 5)
    steps = [torch.randint(0, 50, (3, 5), generator=gen) for _ in range(int(torch.randint(1, 12, (1,), generator=gen)))]
    for i, counts in enumerate(steps):
        window.record(counts)
        got = window.steps()
        assert got.dtype == torch.int64
        assert torch.equal(got, torch.stack(steps[max(0, i - 3) : i + 1]))  # at most W, in order
        assert torch.equal(got.sum(0), window.total())
    got.zero_()  # a new tensor: the ring is untouched
    assert torch.equal(window.steps()[-1], steps[-1])
    window.reset()
    assert tuple(window.steps().shape) == (0, 3, 5)


def test_wrong_shapes_are_rejected() -> None:
    with pytest.raises(ConfigError, match="window must be an int >= 1, got 0"):
        LoadWindow(1, 2, window=0)
    with pytest.raises(ConfigError, match=r"counts must have shape \(1, 2\), got \(2,\)"):
        LoadWindow(1, 2, window=3).record(torch.ones(2))


def _worker(rank: int, port: int, out_dir: str) -> None:
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        window = LoadWindow(2, 3, window=2, group=dist.group.WORLD)
        for step in range(3):
            window.record(torch.full((2, 3), 10 * rank + step))
        # rank 0 kept steps 1, 2 -> 3; rank 1 kept 11, 12 -> 23; summed: 26
        assert window.total().tolist() == [[26] * 3] * 2
        # per step, oldest first: 1 + 11, then 2 + 12
        assert window.steps().tolist() == [[[12] * 3] * 2, [[14] * 3] * 2]
        dist.destroy_process_group()
        Path(out_dir, f"rank{rank}").write_text("ok")
    except BaseException:  # noqa: BLE001 - reported to the parent test
        Path(out_dir, f"rank{rank}").write_text(traceback.format_exc())
        raise


def test_total_and_steps_all_reduce_over_two_gloo_ranks(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    procs = [mp.get_context("fork").Process(target=_worker, args=(r, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    results = [(tmp_path / f"rank{r}").read_text() if (tmp_path / f"rank{r}").exists() else "none" for r in range(2)]
    assert results == ["ok", "ok"], results
