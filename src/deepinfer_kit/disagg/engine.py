"""DisaggregatedEngine: route each request to a prefill engine, then to a decode engine
that loads the prompt's KV the prefill engine saved."""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from typing import Any

import attrs

from deepinfer_kit.cache.tiers.disk_tier import DiskTier
from deepinfer_kit.cache.tiers.manager import tiered
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.engine.engine import Engine
from deepinfer_kit.errors import ConfigError, DeepInferError
from deepinfer_kit.outputs import RequestOutput
from deepinfer_kit.sample.params import SamplingParams

__all__ = ["DisaggregatedEngine", "build_disaggregated", "push_kv_down", "disk_tier"]


class DisaggregatedEngine:
    """Two engines, one job each: ``prefill`` computes a request's prompt (and samples a
    first token, for its time to first token), saving every full prompt block to the
    shared KV folder (``KVRequestParams(save_prompt=True)``); ``decode`` then runs the
    request with ``load_remote=True``: it loads those blocks into its own pool instead of
    computing them, computes the rest of the prompt (under one block) and decodes.

    The decode engine's tokens are the ones one engine would give: greedy and seeded
    (a seeded request draws from its seed and position, wherever it runs), because loaded
    K/V are the K/V the prefill engine computed for the same tokens, model and dtype (the
    files' fingerprint says so; the decode side would recompute anything else).

    Faults: when the prefill engine fails a request (or is dead), the request goes to
    the decode engine all the same and is computed there; a block the prefill engine
    could not write is not waited for (the decode side is told how many leading prompt
    blocks are down, ``KVRequestParams.remote_blocks``); a damaged file reads as missing
    and is recomputed. Neither engine leaks a block (both idle checks hold).

    Both engines must share ``kv_tiers.disk_path`` and ``kv_tiers.hash_key`` and serve
    the same model (:func:`build_disaggregated` sets them up). Either may run worker
    processes with any tensor-parallel size: the files hold whole blocks.

    Args:
        prefill, decode: the two engines (built with tiers).

    Raises:
        ConfigError: an engine without KV tiers.
    """

    def __init__(self, prefill: Engine, decode: Engine) -> None:
        for name, engine in (("prefill", prefill), ("decode", decode)):
            if tiered(engine.cache) is None:
                raise ConfigError(f"{name} engine has no kv_tiers: both sides need a shared disk tier")
        self.prefill = prefill
        self.decode = decode
        self._pending: dict[str, tuple[Sequence[int] | str, SamplingParams | None]] = {}
        self.num_fallbacks = 0  # requests the prefill engine failed, decoded from scratch

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None) -> str:
        """Queue ``request_id`` on the prefill engine (its first token only).

        Raises:
            ConfigError: as :meth:`Engine.add_request` (checked by both engines first).
        """
        self.decode.check_request(prompt, params)
        first = attrs.evolve(params if params is not None else SamplingParams(), max_tokens=1, min_tokens=0, n=1)
        try:
            self.prefill.add_request(request_id, prompt, first, kv={"save_prompt": True})
        except DeepInferError as exc:
            if isinstance(exc, ConfigError):
                raise
            self._to_decode(request_id, prompt, params, remote=False)  # the prefill engine is dead
            return request_id
        cache = tiered(self.prefill.cache)
        assert cache is not None
        cache.watch_saves(request_id)
        self._pending[request_id] = (prompt, params)
        return request_id

    def has_unfinished_requests(self) -> bool:
        """True while either engine has work."""
        return bool(self._pending) or self.decode.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One round of each engine with work; returns the decode engine's finished
        outputs. A request the prefill engine finished moves to the decode engine after
        its blocks are pushed down (:func:`push_kv_down`: the prefill engine's queued saves
        run while it is between rounds)."""
        done: list[RequestOutput] = []
        if self._pending:
            try:
                done = self.prefill.step()
                if done or not self.prefill.has_unfinished_requests():
                    done += push_kv_down(self.prefill)
            except DeepInferError:  # dead: every pending request decodes from scratch
                for rid, (prompt, params) in list(self._pending.items()):
                    self._to_decode(rid, prompt, params, remote=False)
                self._pending.clear()
                done = []
            cache = tiered(self.prefill.cache)
            assert cache is not None
            for out in done:
                prompt, params = self._pending.pop(out.request_id)
                failed = out.outputs[0].finish_reason == "error"
                down = cache.settled_saves(out.request_id)  # pushed down: settled
                self._to_decode(out.request_id, prompt, params, remote=not failed, blocks=down)
        return self.decode.step() if self.decode.has_unfinished_requests() else []

    def _to_decode(self, rid: str, prompt: str | Sequence[int], params: SamplingParams | None, *, remote: bool,
                   blocks: int | None = None) -> None:
        if not remote:
            self.num_fallbacks += 1
        kv = {"load_remote": True, "remote_blocks": blocks} if remote else None
        self.decode.add_request(rid, prompt, params, kv=kv)

    def run(self) -> list[RequestOutput]:
        """Step until every request finished; the decode engine's outputs, in finishing order."""
        outputs: list[RequestOutput] = []
        while self.has_unfinished_requests():
            outputs.extend(self.step())
        outputs.extend(self.decode.flush())
        return outputs

    def close(self) -> None:
        """Close both engines."""
        self.prefill.close()
        self.decode.close()


def disk_tier(engine: Engine) -> DiskTier | None:
    """``engine``'s disk tier (the folder a prefill/decode pair shares), or None when it has
    no KV tiers or its connector has no disk tier."""
    cache = tiered(engine.cache)
    if cache is None:
        return None
    disk = getattr(cache.connector, "disk", None)
    return disk if isinstance(disk, DiskTier) else None


def push_kv_down(engine: Engine) -> list[RequestOutput]:
    """Push ``engine``'s published blocks down its tiers now: commit the rounds in flight
    (their outputs are returned, as :meth:`Engine.flush` returns them), run the copies its
    tiers queued outside any round (``TieredKVCacheManager.transfer_idle``, through the
    runner's device side, speculative or not) and wait for its disk writes. For the
    prefill side of disaggregation, and for a caller that reads the tiers' files or
    counters at a quiet point.

    Raises:
        ConfigError: the engine has no KV tiers.
    """
    cache = tiered(engine.cache)
    if cache is None:
        raise ConfigError("push_kv_down needs an engine with kv_tiers (or components.kv_connector)")
    outputs = engine.flush()
    runner: Any = engine.runner  # in this process: the plain runner's; worker processes: a handle on theirs
    cache.transfer_idle(getattr(runner, "runner", runner).kv_transfer)
    return outputs


def build_disaggregated(config: EngineConfig, folder: str | os.PathLike[str], *, host_blocks: int = 256,
                        disk_blocks: int = 4096, prefetch_timeout_s: float = 5.0,
                        prefill: dict[str, Any] | None = None,
                        decode: dict[str, Any] | None = None) -> DisaggregatedEngine:
    """A prefill engine and a decode engine of ``config`` (``prefill`` / ``decode``: field
    overrides per side, e.g. a smaller pool for prefill) sharing KV through ``folder``
    (one host: a ``tmpfs`` such as ``/dev/shm`` makes it a shared-memory transfer) under
    one fresh hash key. ``prefetch_timeout_s``: how long the decode side waits for a
    block the prefill side has not written (then it recomputes).

    Raises:
        ConfigError: as :func:`build_engine`.
    """
    from deepinfer_kit.engine.build import build_engine

    key = secrets.token_bytes(32)
    tiers = {"host_blocks": host_blocks, "disk_blocks": disk_blocks, "disk_path": os.fspath(folder),
             "hash_key": key, "prefetch_timeout_s": prefetch_timeout_s}
    p = build_engine(config, kv_tiers=tiers, **(prefill or {}))
    try:
        d = build_engine(config, kv_tiers=tiers, **(decode or {}))
    except BaseException:
        p.close()
        raise
    return DisaggregatedEngine(p, d)
