"""Sweeps: one EngineConfig field over several values, the same workload each time; the
table, CSV, JSON and (with matplotlib) PNG of the results."""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from deepinfer_kit.components import Components
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sim.build import build_simulator
from deepinfer_kit.sim.cost_analytic import ModelShape
from deepinfer_kit.sim.expert_records import ExpertRouting
from deepinfer_kit.sim.metrics import PRIORITY_KEYS, SimReport
from deepinfer_kit.sim.protocols import CostModel
from deepinfer_kit.sim.records import SimRequest

__all__ = ["parse_value", "parse_sweep", "with_field", "run_sweep", "format_table",
           "format_priority_table", "write_csv", "write_json", "plot_sweep", "TABLE_COLUMNS"]

SweepRow = tuple[object, SimReport]

#: The columns :func:`format_table` prints (keys of ``SimReport.summary``).
TABLE_COLUMNS = ("requests", "out_tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
                 "tpot_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "queueing_p99_ms",
                 "prefix_hit_rate", "preemptions", "kv_usage_mean", "wall_s")

#: Columns added when expert placement took part (keys of ``ExpertReport.summary``).
EXPERT_COLUMNS = ("moe_balance_mean", "moe_balance_min", "moe_oracle_mean",
                  "moe_step_balance_mean", "moe_slowdown_mean", "moe_rebalances",
                  "moe_replicas_moved")


def parse_value(text: str) -> object:
    """``"512"`` -> 512, ``"0.5"`` -> 0.5, ``"true"``/``"false"`` -> bool, ``"none"`` ->
    None, a JSON object (``'{"num_draft": 3}'``) -> a dict, anything else stays text.

    Raises:
        ConfigError: text starting with ``{`` that is not a JSON object.
    """
    if text.strip().startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"{text!r} is not a JSON object: {exc}") from exc
        if not isinstance(value, dict):
            raise ConfigError(f"{text!r} is not a JSON object")
        return value
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def parse_sweep(text: str) -> tuple[str, list[object]]:
    """``"FIELD=V1,V2,..."`` -> ``(field, values)``; ``FIELD`` is an EngineConfig field or
    ``eplb.NAME`` (a field of its :class:`EplbConfig`).

    Raises:
        ConfigError: no ``=``, no values, or a field EngineConfig does not have.
    """
    field, sep, values = text.partition("=")
    field = field.strip()
    if not sep or not values.strip():
        raise ConfigError(f"--sweep must read FIELD=V1,V2,..., got {text!r}")
    names = [f.name for f in attrs.fields(EngineConfig)]
    if field.startswith("eplb."):
        from deepinfer_kit.eplb.config import EplbConfig  # the eplb package loads torch

        names += [f"eplb.{f.name}" for f in attrs.fields(EplbConfig)]
    if field not in names:
        raise ConfigError(f"--sweep field must be an EngineConfig field {names}, got {field!r}")
    return field, [parse_value(v) for v in values.split(",") if v.strip()]


def with_field(config: Any, field: str, value: object) -> Any:
    """``config`` with ``field`` set to ``value`` (validated by EngineConfig); an
    ``eplb.NAME`` field sets that field of ``config.eplb``.

    Raises:
        ConfigError: an unknown field, a value its validator rejects, or an ``eplb.``
            field while ``config.eplb`` is None.
    """
    head, dot, name = field.partition(".")
    if dot:
        inner = getattr(config, head, None)
        if inner is None:
            raise ConfigError(f"cannot set EngineConfig.{field}: {head} is not set")
        value = with_field(inner, name, value)
        field = head
    try:
        changes: dict[str, Any] = {field: value}
        return attrs.evolve(config, **changes)
    except TypeError as exc:
        raise ConfigError(f"cannot set {type(config).__name__}.{field} = {value!r}: {exc}") from exc


def run_sweep(
    config: EngineConfig,
    field: str | None,
    values: Sequence[object],
    requests: Sequence[SimRequest],
    cost: CostModel | None,
    model: ModelShape,
    *,
    seed: int = 0,
    progress: bool = False,
    on_row: Callable[[SweepRow], None] | None = None,
    routing: ExpertRouting | None = None,
    components: Components | None = None,
) -> list[SweepRow]:
    """Simulate ``requests`` once per value of ``field`` (once with ``config`` as is when
    ``field`` is ``None``), each on freshly built components (``routing``: the simulated
    MoE router when ``config.eplb`` is set; ``components``: yours, as ``build_simulator``
    takes them — give factories, so each run builds fresh ones). ``on_row`` sees each
    result as it comes.

    Raises:
        ConfigError: a value EngineConfig rejects, or a pool too small.
    """
    rows: list[SweepRow] = []
    for value in (values if field is not None else [None]):
        cfg = with_field(config, field, value) if field is not None else config
        sim = build_simulator(cfg, cost, model, seed=seed, routing=routing, components=components)
        row = (value, sim.run(requests, progress=progress))
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:,.1f}"
    return str(v)


def format_table(field: str | None, rows: Sequence[SweepRow]) -> str:
    """The rows as an aligned text table, one line per value (with the expert columns
    when the runs simulated expert placement)."""
    cols = TABLE_COLUMNS + (EXPERT_COLUMNS if rows and rows[0][1].experts is not None else ())
    head = [field or "run", *cols]
    body = [[_fmt(v), *(_fmt(r.summary()[c]) for c in cols)] for v, r in rows]
    return _aligned(head, body)


def format_priority_table(field: str | None, rows: Sequence[SweepRow]) -> str:
    """The latencies of each priority level (:data:`PRIORITY_KEYS`), one line per run
    and level; ``""`` when no run had more than one level."""
    if all(len(r.by_priority) <= 1 for _, r in rows):
        return ""
    head = [field or "run", "priority", *PRIORITY_KEYS]
    body = [[_fmt(v), str(level.priority), *(_fmt(x) for x in level.summary().values())]
            for v, r in rows for level in r.by_priority]
    return _aligned(head, body)


def _aligned(head: list[str], body: list[list[str]]) -> str:
    """``head`` and ``body`` as right-aligned columns."""
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(x.rjust(w) for x, w in zip(line, widths)) for line in [head, *body]]
    return "\n".join(lines)


def write_csv(path: str, field: str | None, rows: Sequence[SweepRow]) -> None:
    """Every scalar metric of every row as CSV (first column: the swept value)."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        keys = list(rows[0][1].summary()) if rows else []
        w.writerow([field or "run", *keys])
        for v, r in rows:
            s = r.summary()
            w.writerow([v, *(s.get(k, "") for k in keys)])


def write_json(path: str, field: str | None, rows: Sequence[SweepRow]) -> None:
    """The full reports (percentiles, KV usage series) as JSON."""
    data = {"field": field,
            "runs": [{"value": v, "report": attrs.asdict(r)} for v, r in rows]}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)


def plot_sweep(path: str, field: str | None, rows: Sequence[SweepRow]) -> None:
    """A PNG of throughput and TTFT / TPOT p50 and p99 against the swept value.

    Raises:
        ConfigError: matplotlib is not installed (it is optional).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("--plot needs matplotlib (pip install matplotlib)") from exc
    xs = [str(v) for v, _ in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    axes[0].bar(xs, [r.output_throughput for _, r in rows])
    axes[0].set_title("output tokens/s")
    for ax, name in ((axes[1], "ttft"), (axes[2], "tpot")):
        for q in ("p50", "p99"):
            ax.plot(xs, [getattr(getattr(r, name), q) * 1e3 for _, r in rows], marker="o", label=q)
        ax.set_title(f"{name.upper()} (ms)")
        ax.legend()
    for ax in axes:
        ax.set_xlabel(field or "run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
