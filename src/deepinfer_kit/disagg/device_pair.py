"""build_device_disaggregated: a prefill engine and a decode engine in one process whose
KV moves device to device over the device link."""

from __future__ import annotations

import secrets
from typing import Any

from deepinfer_kit.components import Components
from deepinfer_kit.disagg.device_link import link_receiver, link_to
from deepinfer_kit.disagg.engine import DisaggregatedEngine
from deepinfer_kit.engine.config import EngineConfig

__all__ = ["build_device_disaggregated"]


def build_device_disaggregated(config: EngineConfig, *, send_slots: int = 64, landing_slots: int = 256,
                               timeout_s: float = 5.0, prefill: dict[str, Any] | None = None,
                               decode: dict[str, Any] | None = None) -> DisaggregatedEngine:
    """A prefill engine and a decode engine of ``config`` in this process whose KV moves
    device to device (:func:`link_to`; ``prefill`` / ``decode``: field overrides per side,
    e.g. ``{"device": "cuda:1"}`` for a decode engine on another GPU), under one fresh
    hash key. No file and no host copy: the prefill engine copies each prompt block into
    a send slot, then into the decode engine's landing slots.

    Raises:
        ConfigError: as :func:`build_engine`.
    """
    from deepinfer_kit.engine.build import build_engine

    key = secrets.token_bytes(32)
    d = build_engine(config, components=Components(kv_connector=link_receiver(key, landing_slots=landing_slots,
                                                                                timeout_s=timeout_s)),
                     **(decode or {}))
    try:
        p = build_engine(config, components=Components(kv_connector=link_to(d, key, send_slots=send_slots)),
                         **(prefill or {}))
    except BaseException:
        d.close()
        raise
    return DisaggregatedEngine(p, d)
