"""Workload traces as JSONL: one request per line, read and written."""

from __future__ import annotations

import json
from collections.abc import Sequence

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sim.records import SimRequest

__all__ = ["read_trace", "write_trace"]

_FIELDS = ("request_id", "arrival_time", "prompt_len", "output_len", "stop_by_eos", "priority",
           "shared_prefix", "shared_prefix_len", "after", "think_time", "prompt_token_ids")


def read_trace(path: str) -> list[SimRequest]:
    """Requests from a JSONL file: per line an object with ``arrival_time``,
    ``output_len`` and ``prompt_len`` or ``prompt_token_ids``, optionally the other
    :class:`SimRequest` fields (``request_id`` defaults to ``"r{line}"``).

    Raises:
        ConfigError: unreadable JSON, a missing or unknown field (names the line).
    """
    out: list[SimRequest] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
                unknown = sorted(set(data) - set(_FIELDS))
                if unknown:
                    raise ValueError(f"unknown fields {unknown}")
                data.setdefault("request_id", f"r{n}")
                tokens = data.get("prompt_token_ids")
                if tokens is not None:
                    data.setdefault("prompt_len", len(tokens))
                req = SimRequest(**data)
                if req.prompt_len < 1 or req.output_len < 1:
                    raise ValueError("prompt_len and output_len must be >= 1")
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"{path}:{n}: bad trace line: {exc}") from exc
            out.append(req)
    return out


def write_trace(requests: Sequence[SimRequest], path: str) -> None:
    """Write ``requests`` as JSONL (defaults omitted); :func:`read_trace` reads it back."""
    defaults = SimRequest("", 0.0, 1, 1)
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            row = {k: getattr(r, k) for k in _FIELDS
                   if k in ("request_id", "arrival_time", "prompt_len", "output_len")
                   or getattr(r, k) != getattr(defaults, k)}
            f.write(json.dumps(row) + "\n")
