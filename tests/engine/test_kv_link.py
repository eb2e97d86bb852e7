"""Prefill and decode engines in two processes over gloo: the blocks and then the
requests cross one ordered channel; the decode process's tokens are one engine's."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch.multiprocessing as mp

from deepinfer_kit.engine.build import build_engine
from deepinfer_kit.sample.params import SamplingParams

_RNG = random.Random(11)
_PROMPTS = [[_RNG.randrange(250) for _ in range(_RNG.randrange(20, 60))] for _ in range(6)]
_CFG = dict(num_blocks=64, block_size=8, max_num_seqs=4, max_model_len=512)
_KEY = b"L" * 32


def _params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=6, temperature=0.0) if i % 2 else SamplingParams(max_tokens=6, temperature=1.0, seed=i)


def _side(rank: int, folder: str, out: str) -> None:
    import queue

    import torch.distributed as dist

    from deepinfer_kit.disagg import push_kv_down
    from deepinfer_kit.disagg.link import KVLinkReceiver, push_saved_blocks, send_close, send_request

    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2)
    tiers = {"host_blocks": 32, "disk_blocks": 256, "disk_path": f"{folder}/disk{rank}", "hash_key": _KEY,
             "prefetch_timeout_s": 10.0}
    engine = build_engine(kv_tiers=tiers, **_CFG)  # type: ignore[arg-type]
    if rank == 0:  # prefill
        store = push_saved_blocks(engine, peer=1)
        for i, p in enumerate(_PROMPTS):
            engine.add_request(str(i), p, SamplingParams(max_tokens=1, temperature=0.0), kv={"save_prompt": True})
            engine.run()
            push_kv_down(engine)
            send_request(store, str(i), p, _params(i))
        send_close(store)
    else:  # decode
        arrived: queue.Queue[tuple[str, list[int], SamplingParams]] = queue.Queue()
        disk = engine.cache.connector.disk  # type: ignore[attr-defined]
        link = KVLinkReceiver(disk.store, lambda r, p, s: arrived.put((r, p, s)), peer=0)
        link.join(60)
        got = {}
        while not arrived.empty():
            rid, prompt, params = arrived.get()
            engine.add_request(rid, prompt, params, kv={"load_remote": True})
            got.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.run()})
        engine.check_idle()
        Path(out).write_text(json.dumps({"tokens": got, "disk_hits": engine.cache.tier_stats.disk_hits,  # type: ignore[attr-defined]
                                         "error": repr(link.error), "rejected": link.rejected}))
    engine.close()
    dist.destroy_process_group()


def test_two_processes_over_gloo_give_one_engines_tokens(tmp_path: Path) -> None:
    engine = build_engine(**_CFG)  # type: ignore[arg-type]
    for i, p in enumerate(_PROMPTS):
        engine.add_request(str(i), p, _params(i))
    reference = {o.request_id: list(o.outputs[0].token_ids) for o in engine.run()}
    engine.close()
    out = tmp_path / "decode.json"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.start_processes(_side, args=(str(tmp_path), str(out)), nprocs=2, start_method="spawn")
    result = json.loads(out.read_text())
    assert result["error"] == "None" and result["rejected"] == 0
    assert result["tokens"] == reference
    assert result["disk_hits"] == sum((len(p) - 1) // 8 for p in _PROMPTS)
