"""worker="launched": ranks started with the launcher's environment (as torchrun sets it)
each run the whole engine on their shard and produce the single-process engine's tokens."""

from __future__ import annotations

import socket
from typing import Any

import torch.multiprocessing as mp

from deepinfer_kit import SamplingParams, build_engine
from comm_ranks import launched_engine

PROMPTS = [[5, 9, 200, 31], [77] * 10, [1, 2, 3]]


def test_two_launched_ranks_generate_the_single_process_tokens() -> None:
    engine = build_engine(num_blocks=32, block_size=8, max_model_len=64)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=6, temperature=0.0))
    want = {o.request_id: list(o.outputs[0].token_ids) for o in engine.run()}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ctx = mp.get_context("spawn")
    out: Any = ctx.Queue()
    procs = [ctx.Process(target=launched_engine, args=(r, 2, port, PROMPTS, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted((out.get(timeout=300) for _ in procs), key=lambda g: g[0])
    for p in procs:
        p.join(timeout=60)
    assert [tokens for _, tokens, _ in got] == [want, want]
    assert [heads for _, _, heads in got] == [2, 2]  # each rank holds half of the 4 query heads
