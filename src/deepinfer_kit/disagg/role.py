"""What a server does in a prefill/decode pair (``deepinfer-kit serve --kv-role``), and
holding a ``save_prompt`` request's answer until its prompt's blocks are down."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from deepinfer_kit.cache.tiers.config import KVRequestParams
from deepinfer_kit.cache.tiers.manager import tiered
from deepinfer_kit.disagg.engine import disk_tier, push_kv_down
from deepinfer_kit.disagg.link_connector import DeviceLinkConnector
from deepinfer_kit.engine.engine import Engine
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.outputs import RequestOutput
from deepinfer_kit.sample.params import SamplingParams

__all__ = ["KV_ROLES", "check_kv_role", "role_request", "PromptSaves"]

KV_ROLES = ("prefill", "decode")


def check_kv_role(role: str | None, engine: Engine) -> None:
    """Refuse a role the engine cannot play: both need KV tiers with a disk folder (the
    folder the pair shares), or a device link with the half the role uses
    (:mod:`~deepinfer_kit.disagg.serve_link`).

    Raises:
        ConfigError: an unknown role, or an engine without a disk tier.
    """
    if role is None:
        return
    if role not in KV_ROLES:
        raise ConfigError(f"kv_role must be one of {KV_ROLES} or None, got {role!r}")
    cache = tiered(engine.cache)
    link = cache.connector if cache is not None else None
    if isinstance(link, DeviceLinkConnector):  # a device link (--kv-link): the half the role uses
        if (link.sender if role == "prefill" else link.landing) is None:
            raise ConfigError(f"kv_role={role!r}: the engine's device link has no "
                              f"{'sending' if role == 'prefill' else 'landing'} half")
        return
    if disk_tier(engine) is None:
        raise ConfigError(f"kv_role={role!r} needs kv_tiers with disk_blocks and disk_path (the folder the "
                          f"prefill and decode servers share) and the same hash_key on both, or a device link")


def role_request(role: str | None, params: SamplingParams,
                 kv: KVRequestParams | Mapping[str, Any] | None) -> tuple[SamplingParams, KVRequestParams | None]:
    """The sampling and KV parameters a request runs with on a server of ``role``: on a
    prefill server one token (``n=1``, no logprobs, no grammar: only the prompt's KV
    matters) and ``save_prompt`` unless ``kv`` says otherwise; on a decode server
    ``load_remote`` unless ``kv`` says otherwise; else as given. Pure.

    Raises:
        ConfigError: ``kv`` is not valid KV parameters (names the key).
    """
    params_kv = KVRequestParams.coerce(kv)
    if role == "prefill":
        params = attrs.evolve(params, max_tokens=1, min_tokens=0, n=1, logprobs=None, prompt_logprobs=None,
                              structured_outputs=None)
        return params, params_kv if params_kv is not None else KVRequestParams(save_prompt=True)
    if role == "decode":
        return params, params_kv if params_kv is not None else KVRequestParams(load_remote=True)
    return params, params_kv


class PromptSaves:
    """The final outputs of ``save_prompt`` requests, held until the tiers report their
    prompt's blocks down (``TieredKVCacheManager.settled_saves``): a prefill server
    answers only when the decode server can read the whole prompt, and says how much of
    it (``RequestOutput.kv_transfer_params = {"remote_blocks": n}``, for the decode side's
    ``KVRequestParams.remote_blocks``: it waits for no block that will not come; over a
    device link also ``"remote_link"``, the link's id). Driven by the engine's
    thread (``AsyncLLM``): :meth:`watch` after queueing, :meth:`hold` on each output,
    :meth:`release` after each round; with the engine idle, :meth:`release` pushes the
    tiers' queued copies and disk writes (``push_kv_down``), so nothing is held past an
    idle engine."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._watched: set[str] = set()
        self._held: dict[str, RequestOutput] = {}

    def watch(self, request_id: str, kv: KVRequestParams | None) -> None:
        """Hold ``request_id``'s final output when ``kv`` saves its prompt (and the engine has tiers)."""
        cache = tiered(self._engine.cache)
        if kv is not None and kv.save_prompt and cache is not None:
            cache.watch_saves(request_id)
            self._watched.add(request_id)

    def hold(self, out: RequestOutput) -> bool:
        """True when ``out`` is a watched request's final output, now held."""
        if out.finished and out.request_id in self._watched:
            self._watched.discard(out.request_id)
            self._held[out.request_id] = out
            return True
        return False

    def release(self, dispatch: Callable[[RequestOutput], None]) -> None:
        """Hand ``dispatch`` the held outputs whose prompt is down (pushing the tiers first
        when the engine is idle; the outputs that flush returns go through :meth:`hold`)."""
        if not self._held:
            return
        engine = self._engine
        if not engine.has_unfinished_requests():
            for out in push_kv_down(engine):
                if not self.hold(out):
                    dispatch(out)
        cache = tiered(engine.cache)
        assert cache is not None
        for rid, out in list(self._held.items()):
            down = cache.settled_saves(rid)
            if down is not None:
                del self._held[rid]
                out.kv_transfer_params = {"remote_blocks": down}
                link = getattr(cache.connector, "link_id", None)
                if isinstance(link, str):  # over a device link: which one
                    out.kv_transfer_params["remote_link"] = link
                dispatch(out)

    @property
    def num_held(self) -> int:
        """Outputs held now."""
        return len(self._held)
