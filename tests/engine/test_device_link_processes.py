"""Prefill and decode engines in two processes over a device link: block headers and
requests over one gloo group, block bytes over a second group (the NCCL group between
GPUs; gloo here), straight from the prefill engine's send slots into the decode engine's
landing slots. The decode process's tokens are one engine's, every usable prompt block
loaded from the link."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from deepinfer_kit.engine.build import build_engine
from deepinfer_kit.sample.params import SamplingParams

_RNG = random.Random(17)
_HEAD = [_RNG.randrange(250) for _ in range(24)]
_PROMPTS = [(_HEAD if i % 2 else []) + [_RNG.randrange(250) for _ in range(_RNG.randrange(20, 50))] for i in range(6)]
_CFG = dict(num_blocks=64, block_size=8, max_num_seqs=4, max_model_len=512)
_KEY = b"D" * 32


def _params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=6, temperature=0.0) if i % 2 else SamplingParams(max_tokens=6, temperature=1.0, seed=i)


def _side(rank: int, folder: str, out: str, cuda: bool = False) -> None:
    import queue

    import torch
    import torch.distributed as dist

    from deepinfer_kit.components import Components
    from deepinfer_kit.disagg import push_kv_down
    from deepinfer_kit.disagg.device_link import link_connector, link_receiver, link_sender, receive_into
    from deepinfer_kit.disagg.link import send_close, send_request

    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2)
    if cuda:
        torch.cuda.set_device(rank)
    data = dist.new_group(backend="nccl" if cuda else "gloo")
    cfg = dict(_CFG, device=f"cuda:{rank}") if cuda else _CFG
    if rank == 0:  # prefill
        engine = build_engine(components=Components(kv_connector=link_sender(1, _KEY, data_group=data)), **cfg)  # type: ignore[arg-type]
        link = link_connector(engine)
        assert link.sender is not None
        for i, p in enumerate(_PROMPTS):
            engine.add_request(str(i), p, SamplingParams(max_tokens=1, temperature=0.0), kv={"save_prompt": True})
            engine.cache.watch_saves(str(i))  # type: ignore[attr-defined]
            engine.run()
            push_kv_down(engine)
            down = engine.cache.settled_saves(str(i))  # type: ignore[attr-defined]
            send_request(link.sender, str(i), p, (_params(i), down))  # type: ignore[arg-type]
        send_close(link.sender)  # type: ignore[arg-type]
        engine.check_idle()
    else:  # decode
        engine = build_engine(components=Components(kv_connector=link_receiver(_KEY, timeout_s=10.0)), **cfg)  # type: ignore[arg-type]
        arrived: queue.Queue[tuple[str, list[int], tuple[SamplingParams, int]]] = queue.Queue()
        receiver = receive_into(engine, lambda r, p, s: arrived.put((r, p, s)), 0, data_group=data)
        receiver.join(120)
        got, told = {}, {}
        while not arrived.empty():
            rid, prompt, (params, down) = arrived.get()
            told[rid] = down
            engine.add_request(rid, prompt, params, kv={"load_remote": True, "remote_blocks": down})
            got.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.run()})
        engine.check_idle()
        stats = link_connector(engine).stats
        Path(out).write_text(json.dumps({"tokens": got, "told": told, "loaded": stats.host_hits,
                                         "late": stats.late_reads, "error": repr(receiver.error),
                                         "rejected": receiver.rejected}))
    engine.close()
    dist.destroy_process_group()


def _reference(**kw: object) -> dict[str, list[int]]:
    engine = build_engine(**_CFG, **kw)  # type: ignore[arg-type]
    for i, p in enumerate(_PROMPTS):
        engine.add_request(str(i), p, _params(i))
    reference = {o.request_id: list(o.outputs[0].token_ids) for o in engine.run()}
    engine.close()
    return reference


def _check(result: dict[str, Any], reference: dict[str, list[int]]) -> None:
    assert result["error"] == "None" and result["rejected"] == 0
    assert result["tokens"] == reference
    usable = {str(i): (len(p) - 1) // 8 for i, p in enumerate(_PROMPTS)}
    assert result["told"] == usable  # every usable prompt block went across, shared prefix too
    assert result["late"] == 0
    # the decode side loads what its own cache lacks: the shared head once, every other block
    head = len(_HEAD) // 8
    assert result["loaded"] == sum(usable.values()) - head * (sum(1 for i in range(6) if i % 2) - 1)


def _run(tmp_path: Path, cuda: bool) -> dict[str, Any]:
    out = tmp_path / "decode.json"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.start_processes(_side, args=(str(tmp_path), str(out), cuda), nprocs=2, start_method="spawn")
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def test_two_processes_over_a_device_link_give_one_engines_tokens(tmp_path: Path) -> None:
    _check(_run(tmp_path, False), _reference())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_over_nccl_give_one_engines_tokens(tmp_path: Path) -> None:
    """The blocks go GPU to GPU over NCCL (send slots on cuda:0, landing slots on cuda:1)."""
    _check(_run(tmp_path, True), _reference(device="cuda:0"))


def _stuck_peer(rank: int, folder: str, out: str) -> None:
    import time

    import torch
    import torch.distributed as dist

    from deepinfer_kit.disagg.link_sender import LinkSender

    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2)
    if rank == 1:  # joined, never receives; stays until the sender is done
        deadline = time.monotonic() + 120
        while not Path(out).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return
    sender = LinkSender(b"f" * 16, 1, timeout_s=1.0)
    for i in range(24):  # 24 MiB: more than the sockets buffer
        sender.submit(bytes([i]) * 16, torch.zeros(1 << 20, dtype=torch.uint8), i)
    drained = sender.drain(120)
    done = sender.finished()
    Path(out).write_text(json.dumps({"drained": drained, "sent": [ok for _, ok in done],
                                     "tokens": [t for t, _ in done], "error": repr(sender.error)}))
    sender.close()


def test_a_peer_that_stops_receiving_fails_the_sends_instead_of_hanging(tmp_path: Path) -> None:
    out = tmp_path / "sender.json"
    mp.start_processes(_stuck_peer, args=(str(tmp_path), str(out)), nprocs=2, start_method="spawn")
    result = json.loads(out.read_text())
    assert result["drained"] and result["tokens"] == list(range(24))  # every send ended, in order
    sent = result["sent"]
    assert not all(sent) and "Timed out" in result["error"]
    first = sent.index(False)
    assert not any(sent[first:])  # the channel is broken: every later send fails
