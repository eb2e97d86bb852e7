"""Rank bodies for the launched-tiers tests (module level: spawned processes import them)."""

from __future__ import annotations

import os
from typing import Any

import torch

POOL = {"num_blocks": 24, "block_size": 8, "max_num_seqs": 2, "max_model_len": 192}


def prompts() -> list[list[int]]:
    """Prompts over four shared 64-token heads, so later ones find earlier prefixes."""
    import random

    rng = random.Random(13)
    heads = [[rng.randrange(250) for _ in range(64)] for _ in range(4)]
    return [heads[i % 4] + [rng.randrange(250) for _ in range(rng.randrange(3, 20))] for i in range(12)]


def serve(engine: Any, requests: list[list[int]], tag: str) -> dict[str, list[int]]:
    """One request at a time, greedy (each finds the earlier prefixes where they went)."""
    from deepinfer_kit import SamplingParams

    out: dict[str, list[int]] = {}
    for i, p in enumerate(requests):
        engine.add_request(f"{tag}{i}", p, SamplingParams(max_tokens=5, temperature=0.0))
        out.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.run()})
    return out


def launched_tiers(rank: int, world: int, port: int, folder: str, lose_files_on: int | None, out: Any) -> None:
    """A launched rank with host and disk tiers: serve the prompts, forget the device and
    host copies (and, on rank ``lose_files_on``, delete this rank's files), serve them
    again; report the tokens and the tier counters of each pass."""
    from deepinfer_kit import build_engine
    from deepinfer_kit.disagg import push_kv_down

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                      RANK=str(rank), LOCAL_RANK=str(rank))
    engine = build_engine(worker="launched", tensor_parallel=world, collective_timeout=30,
                          kv_tiers={"host_blocks": 16, "disk_blocks": 256, "disk_path": folder}, **POOL)
    first = serve(engine, prompts(), "a")
    push_kv_down(engine)
    cache: Any = engine.cache
    loaded = cache.tier_stats.loaded_tokens
    host = cache.connector.host
    for s in range(host.capacity):  # the second pass finds the prompts on disk only
        if host.key(s) is not None:
            host.drop(s)
    cache._evict(cache._index, cache._index.num_evictable)
    files = sorted(p for p in os.listdir(folder))
    if rank == lose_files_on:
        sub = os.path.join(folder, files[rank] if len(files) > rank else files[0])
        for name in os.listdir(sub):
            os.remove(os.path.join(sub, name))
    second = serve(engine, prompts(), "b")
    engine.flush()
    engine.check_idle()
    stats = cache.tier_stats
    out.put((rank, first, second, loaded, stats.loaded_tokens - loaded, stats.failed_reads, files))
    engine.close()


class _Reports:
    """A device side whose reports are given: (saved, failed loads) per call."""

    def __init__(self, reports: list[tuple[list[int], list[int]]]) -> None:
        self.reports = reports

    def start_save_kv(self, plan: Any) -> None: ...

    def start_load_kv(self, plan: Any) -> None: ...

    def wait_for_load(self) -> None: ...

    def get_finished(self) -> Any:
        from deepinfer_kit.cache.tiers.records import TransferOutput

        saved, failed = self.reports.pop(0)
        return None if not saved and not failed else TransferOutput(saved=saved, failed_loads=failed)


def agreed_loads(rank: int, port: int, out: Any) -> None:
    """Two ranks' reports through AgreedLoads: rank 1 fails a load in the second round."""
    import torch.distributed as dist

    from deepinfer_kit.cache.tiers.rank_agreement import AgreedLoads

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mine = [([1], []), ([2], [7, 9] if rank == 1 else []), ([], [])]
    worker = AgreedLoads(_Reports(mine), dist.new_group(backend="gloo"))
    got = []
    for _ in range(3):
        r = worker.get_finished()
        got.append(None if r is None else (r.saved, r.failed_loads))
    out.put((rank, got))
    dist.destroy_process_group()
