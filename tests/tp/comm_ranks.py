"""Rank bodies for the communicator tests (module level: spawned processes import them)."""

from __future__ import annotations

from typing import Any

import torch

from deepinfer_kit.comm import TimedCommunicator, TorchCommunicator, WorldSpec, join_world
from deepinfer_kit.errors import CollectiveError


def collectives(rank: int, world: int, address: str, out: Any) -> None:
    """Run every collective once, then (rank 0 only) one that rank 1 never joins."""
    torch.set_num_threads(1)
    groups = join_world(WorldSpec(rank, world, address), tensor_parallel=world, expert_parallel=1,
                        timeout=2.0, device=torch.device("cpu"))
    comm = groups.tp
    assert isinstance(comm, TimedCommunicator) and isinstance(comm.inner, TorchCommunicator)
    assert groups.timed is comm
    got: dict[str, Any] = {"rank": comm.rank, "world": comm.world_size}
    got["reduce"] = comm.all_reduce(torch.full((3,), float(rank + 1))).tolist()
    got["gather"] = comm.all_gather(torch.full((2, 1), float(rank)), 1).tolist()
    got["broadcast"] = comm.broadcast(torch.full((2,), float(rank)), 1).tolist()
    comm.barrier()
    if rank == 0:  # rank 1 has returned: this one can never complete
        try:
            comm.all_reduce(torch.ones(1))
        except CollectiveError as exc:
            got["lonely"] = str(exc)
    else:
        got["lonely"] = None
    out.put(got)


def launched_engine(rank: int, world: int, port: int, prompts: list[list[int]], out: Any) -> None:
    """A rank as a launcher starts it: the standard environment, then
    ``build_engine(worker="launched")`` and greedy generation of ``prompts``."""
    import os

    from deepinfer_kit import SamplingParams, build_engine

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                      RANK=str(rank), LOCAL_RANK=str(rank))
    engine = build_engine(worker="launched", tensor_parallel=world, collective_timeout=60,
                          num_blocks=32, block_size=8, max_model_len=64)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=6, temperature=0.0))
    tokens = {o.request_id: list(o.outputs[0].token_ids) for o in engine.run()}
    heads = engine.runner.model.decoder_layers[0].self_attn.num_heads  # type: ignore[attr-defined]
    out.put((rank, tokens, heads))
