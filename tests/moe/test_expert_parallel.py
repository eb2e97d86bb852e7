"""Expert parallelism over 2 and 4 gloo processes equals the single-process MoELayer, also
after EPLB rebalances that move expert weights rank to rank."""

from __future__ import annotations

import random
import socket
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer_kit.eplb.records import Placement
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.moe import MoEConfig, MoELayer
from deepinfer_kit.moe.ep_dispatcher import ExpertParallelDispatcher
from deepinfer_kit.moe.selectors import make_selector

PREFIX = "model.layers.0.mlp."
CONFIGS = {
    "softmax": MoEConfig(hidden_size=16, num_experts=8, top_k=2, intermediate_size=12),
    "deepseek_shared": MoEConfig(
        hidden_size=16, num_experts=8, top_k=3, intermediate_size=12, routing="deepseek_v3",
        n_group=4, topk_group=2, routed_scaling_factor=2.0, num_shared_experts=1,
        shared_intermediate_size=10,
    ),
}


def _checkpoint(cfg: MoEConfig) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    h, i = cfg.hidden_size, cfg.intermediate_size
    w = {PREFIX + "gate.weight": torch.randn(cfg.num_experts, h, generator=gen)}
    if cfg.routing == "deepseek_v3":
        w[PREFIX + "gate.e_score_correction_bias"] = torch.randn(cfg.num_experts, generator=gen) * 0.2
    for e in range(cfg.num_experts):
        for name, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            w[f"{PREFIX}experts.{e}.{name}.weight"] = torch.randn(*shape, generator=gen) / 4
    if cfg.num_shared_experts:
        s = cfg.shared_intermediate_size
        for name, shape in (("gate_proj", (s, h)), ("up_proj", (s, h)), ("down_proj", (h, s))):
            w[f"{PREFIX}shared_experts.{name}.weight"] = torch.randn(*shape, generator=gen) / 4
    return w


def _phy2log(experts: int, world: int, seed: int) -> list[int]:
    """Every expert once plus ``world`` replicas of the first experts, shuffled."""
    slots = list(range(experts)) + list(range(world))
    random.Random(seed).shuffle(slots)
    return slots


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    try:
        if dist.is_initialized():  # inherited through fork
            dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        for name, cfg in CONFIGS.items():
            weights = _checkpoint(cfg)
            reference = MoELayer(cfg, impl="ref")
            reference.load_hf_weights(weights, PREFIX)
            dispatcher = ExpertParallelDispatcher(cfg.num_experts, _phy2log(cfg.num_experts, world, 3))
            layer = MoELayer(cfg, impl="ref", dispatcher=dispatcher)
            layer.load_hf_weights(weights, PREFIX)
            for step, selector in enumerate(("static", "even", "balanced")):
                dispatcher.selector = make_selector(selector)  # every rank alike
                tokens = 0 if (rank == 1 and step == 1) else 5 + 7 * rank + step
                every = sum(0 if (r == 1 and step == 1) else 5 + 7 * r + step for r in range(world))
                hidden = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(100 * rank + step))
                got = layer(hidden)
                torch.testing.assert_close(got, reference(hidden), rtol=1e-5, atol=1e-5, msg=f"{name} step {step}")
                counts = layer.last_expert_counts
                assert counts is not None and int(counts.sum()) == every * cfg.top_k  # the whole load
            for round_ in range(2):  # EPLB rebalances: weights move rank to rank
                old, new = dispatcher.phy2log, _phy2log(cfg.num_experts, world, 10 + round_)
                assert layer.apply_placement(new) == sum(o != n for o, n in zip(old, new))
                local = torch.tensor(dispatcher.local_experts)
                per = len(new) // world
                assert dispatcher.local_experts == tuple(new[rank * per : (rank + 1) * per])
                assert torch.equal(layer.experts.gate_up, reference.experts.gate_up[local])
                assert torch.equal(layer.experts.down, reference.experts.down[local])
                hidden = torch.randn(9 + rank, cfg.hidden_size, generator=torch.Generator().manual_seed(7 * rank + round_))
                torch.testing.assert_close(layer(hidden), reference(hidden), rtol=1e-5, atol=1e-5,
                                           msg=f"{name} after rebalance {round_}")
        dist.barrier()
        dist.destroy_process_group()
        Path(out_dir, f"rank{rank}").write_text("ok")
    except BaseException:  # noqa: BLE001 - reported to the parent test
        Path(out_dir, f"rank{rank}").write_text(traceback.format_exc())
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_equals_single_process(world: int, tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, str(tmp_path))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.kill()
    results = {r: (tmp_path / f"rank{r}").read_text() if (tmp_path / f"rank{r}").exists() else "no result"
               for r in range(world)}
    assert all(v == "ok" for v in results.values()), results


def test_placement_must_cover_every_expert_and_divide_the_world() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match=r"phy2log must give every expert a slot, got none for \[2\]"):
            ExpertParallelDispatcher(3, [0, 1, 1])
        with pytest.raises(ConfigError, match=r"phy2log entries must be in \[0, 3\)"):
            ExpertParallelDispatcher(3, [0, 1, 2, 3])
        dispatcher = ExpertParallelDispatcher(3, [2, 0, 1, 2])
        assert dispatcher.local_experts == (2, 0, 1, 2)
        ids = torch.tensor([2, 2, 2, 2, 0])
        assert sorted(set(dispatcher.physical_slots(ids).tolist()[:4])) == [0, 3]  # both replicas used
        placement = Placement(
            phy2log=torch.tensor([[0, 1, 2, 2], [2, 1, 0, 1]]),
            log2phy=torch.tensor([[[0, -1], [1, -1], [2, 3]], [[2, -1], [1, 3], [0, -1]]]),
            logcnt=torch.tensor([[1, 1, 2], [1, 2, 1]]),
        )
        assert ExpertParallelDispatcher.from_placement(placement, 1).local_experts == (2, 1, 0, 1)
    finally:
        dist.destroy_process_group()
