"""The trace JSON schema (version 1, with optional EPLB fields): the document types, and dumps / loads / validate.

A trace document is what :class:`~deepinfer_kit.viewer.recorder.TraceRecorder` builds from
a real engine run and what the HTML viewer, the text trace and other tools read. The
field-by-field description is docs/trace_schema.md; the types below are its checked form.
Everything is plain JSON (no NaN or infinities: a logprob of ``-inf`` is ``null``).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, TypedDict

from deepinfer_kit.errors import ConfigError

if TYPE_CHECKING:  # Python 3.10 has no typing.NotRequired; annotations here stay strings
    from typing_extensions import NotRequired

__all__ = [
    "SCHEMA_NAME",
    "SCHEMA_VERSION",
    "TraceDoc",
    "StepDoc",
    "EplbMeta",
    "EplbStepDoc",
    "RebalanceDoc",
    "dumps",
    "loads",
    "validate",
]

SCHEMA_NAME = "deepinfer_kit.trace"
SCHEMA_VERSION = 1


class EplbMeta(TypedDict):
    """Live EPLB's fixed facts: ``E`` experts on ``P`` slots per layer over ``G`` GPUs."""

    num_experts: int
    num_slots: int
    num_gpus: int
    interval: int
    window: int
    dispatch: NotRequired[str]


class Meta(TypedDict):
    """The run's fixed facts: pool geometry, limits, model (``eplb`` only with EPLB on)."""

    model: str
    block_size: int
    num_blocks: int
    max_num_seqs: int
    overlap: bool
    speculative: bool
    eplb: NotRequired[EplbMeta]


class RequestDoc(TypedDict):
    """One sequence (a fork child is its own entry, ``parent`` names its request)."""

    prompt_len: int
    parent: str | None
    n: int
    filter: str
    logprobs: int | None


class ChunkDoc(TypedDict):
    """One request's work in a step: ``q`` tokens from position ``start``."""

    request: str
    kind: str
    start: int
    q: int
    cached: int
    sampled: list[int]
    drafted: list[int]
    verified: int
    accepted: int


class BlocksDoc(TypedDict):
    """The KV pool after the step: tables, reference counts, sharing, reuse, eviction."""

    tables: dict[str, list[int]]
    ref_counts: list[int]
    cached: list[int]
    shared: list[int]
    copies: list[list[int]]
    prefix_hits: dict[str, list[int]]
    evicted: list[int]
    num_evicted: int
    num_free: int
    windows: NotRequired[dict[str, list[list[int]]]]


class CandidateDoc(TypedDict):
    """One candidate token of a draw: raw-logit logprob (``null`` for ``-inf``), rank."""

    token: int
    text: str
    logprob: float | None
    rank: int


class SampleDoc(TypedDict):
    """One drawn token, the filter that applied and, with logprobs, its candidates;
    ``committed`` is false for a draw the commit dropped."""

    request: str
    token: int
    text: str
    filter: str
    committed: bool
    candidates: list[CandidateDoc]


class TokenDoc(TypedDict):
    """A generated token: the step that sampled it and the step that committed it."""

    request: str
    index: int
    token: int
    sampled_in: int
    committed_in: int


class QueuesDoc(TypedDict):
    """Sequence ids per queue after the step (``finished``: all finished so far)."""

    waiting: list[str]
    running: list[str]
    finished: list[str]


class RebalanceDoc(TypedDict):
    """A rebalance that ran just before the step: GPU loads ``[L][G]`` of its window under
    the old and the new placement, their balancedness, and the slots per layer it changed."""

    after_step: int
    moved_slots: int
    balancedness_before: float
    balancedness_after: float
    before: list[list[float]]
    after: list[list[float]]
    changed: list[list[int]]


class EplbStepDoc(TypedDict):
    """The placement ``phy2log`` ``[L][P]`` the step ran under, token copies per slot
    ``[L][P]`` and per GPU ``[L][G]`` as the replica selector dispatched them, per GPU
    before selection (``[L][G]``: each expert's routed copies split evenly over its
    replicas, what the placement alone gives), and the rebalance that installed the
    placement (or null)."""

    phy2log: list[list[int]]
    slots: list[list[int]]
    gpu_loads: list[list[int]]
    gpu_loads_before: NotRequired[list[list[int]]]
    rebalance: RebalanceDoc | None


class StepDoc(TypedDict):
    """Everything one step did and the state it left."""

    step: int
    committed_in: int
    budget: int
    batched_tokens: int
    queues: QueuesDoc
    chunks: list[ChunkDoc]
    preempted: list[str]
    finished: list[str]
    blocks: BlocksDoc
    sampling: list[SampleDoc]
    tokens: list[TokenDoc]
    experts: list[list[int]] | None
    eplb: NotRequired[EplbStepDoc]


class TraceDoc(TypedDict):
    """A whole run: ``schema``, ``version``, ``meta``, ``requests`` and ``steps``."""

    schema: str
    version: int
    meta: Meta
    requests: dict[str, RequestDoc]
    steps: list[StepDoc]


_FILTERS = ("greedy", "temperature", "top-k", "top-p", "min-p")


def dumps(doc: TraceDoc, *, indent: int | None = None) -> str:
    """``doc`` as JSON text, after :func:`validate`. Pure.

    Raises:
        ConfigError: ``doc`` does not follow the schema (names the field).
    """
    validate(doc)
    return json.dumps(doc, indent=indent, allow_nan=False, separators=(",", ":") if indent is None else None)


def loads(text: str) -> TraceDoc:
    """The document in ``text``, validated. Pure.

    Raises:
        ConfigError: ``text`` is not JSON, or is another schema, version or shape.
    """
    try:
        raw: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"trace is not JSON: {exc}") from exc
    validate(raw)
    doc: TraceDoc = raw
    return doc


def validate(doc: Any) -> None:
    """Check that ``doc`` is a version-1 trace: every field present with its JSON type,
    filters from the known set, ``sum q <= budget`` and sampled <= committed step in
    every step; with ``meta.eplb``, every step's ``eplb`` with ``P`` slots per layer and
    GPU loads that sum their slots. O(size of the document); mutates nothing.

    Raises:
        ConfigError: naming the first field that is wrong and its value.
    """
    _obj(doc, "trace")
    if doc.get("schema") != SCHEMA_NAME:
        raise ConfigError(f"schema must be {SCHEMA_NAME!r}, got {doc.get('schema')!r}")
    if doc.get("version") != SCHEMA_VERSION:
        raise ConfigError(f"version must be {SCHEMA_VERSION}, got {doc.get('version')!r}")
    _fields(doc, "trace", TraceDoc)
    _fields(doc["meta"], "meta", Meta)
    eplb = doc["meta"].get("eplb")
    if eplb is not None:
        _fields(eplb, "meta.eplb", EplbMeta)
    for rid, req in _obj(doc["requests"], "requests").items():
        _fields(req, f"requests[{rid!r}]", RequestDoc)
        _filter(req["filter"], f"requests[{rid!r}].filter")
    for i, step in enumerate(_list(doc["steps"], "steps")):
        _step(step, f"steps[{i}]")
        if (eplb is None) != ("eplb" not in step):
            raise ConfigError(f"steps[{i}].eplb must be present exactly when meta.eplb is, "
                              f"got meta.eplb {eplb!r}")
        if eplb is not None:
            _eplb_step(step["eplb"], eplb, f"steps[{i}].eplb")


def _eplb_step(step: Any, meta: EplbMeta, where: str) -> None:
    """Field types, ``P`` slots per layer, and each GPU's load = the sum of its slots."""
    _fields(step, where, EplbStepDoc)
    if step["rebalance"] is not None:
        _fields(step["rebalance"], f"{where}.rebalance", RebalanceDoc)
    per_gpu = meta["num_slots"] // max(1, meta["num_gpus"])
    for name in ("phy2log", "slots"):
        for layer, row in enumerate(_list(step[name], f"{where}.{name}")):
            if len(_list(row, f"{where}.{name}[{layer}]")) != meta["num_slots"]:
                raise ConfigError(f"{where}.{name}[{layer}] must have num_slots="
                                  f"{meta['num_slots']} entries, got {len(row)}")
    sums = [[sum(row[g * per_gpu:(g + 1) * per_gpu]) for g in range(meta["num_gpus"])] for row in step["slots"]]
    if step["gpu_loads"] != sums:
        raise ConfigError(f"{where}.gpu_loads must sum the slots of each GPU ({sums}), got {step['gpu_loads']!r}")
    before = step.get("gpu_loads_before")
    if before is not None:
        shape = [len(_list(row, f"{where}.gpu_loads_before")) for row in _list(before, f"{where}.gpu_loads_before")]
        totals = [sum(row) for row in before]
        if shape != [meta["num_gpus"]] * len(sums) or totals != [sum(row) for row in sums]:
            raise ConfigError(f"{where}.gpu_loads_before must hold num_gpus={meta['num_gpus']} loads per layer "
                              f"summing to the layer's copies {[sum(row) for row in sums]}, got {before!r}")


def _step(step: Any, where: str) -> None:
    _fields(step, where, StepDoc)
    _fields(step["queues"], f"{where}.queues", QueuesDoc)
    _fields(step["blocks"], f"{where}.blocks", BlocksDoc)
    used = 0
    for j, chunk in enumerate(_list(step["chunks"], f"{where}.chunks")):
        _fields(chunk, f"{where}.chunks[{j}]", ChunkDoc)
        used += chunk["q"]
    if used != step["batched_tokens"] or used > step["budget"]:
        raise ConfigError(
            f"{where}: sum of q must equal batched_tokens and be <= budget "
            f"({step['budget']}), got sum {used}, batched_tokens {step['batched_tokens']}"
        )
    for j, sample in enumerate(_list(step["sampling"], f"{where}.sampling")):
        _fields(sample, f"{where}.sampling[{j}]", SampleDoc)
        _filter(sample["filter"], f"{where}.sampling[{j}].filter")
        for k, cand in enumerate(_list(sample["candidates"], f"{where}.sampling[{j}].candidates")):
            _fields(cand, f"{where}.sampling[{j}].candidates[{k}]", CandidateDoc)
    for j, tok in enumerate(_list(step["tokens"], f"{where}.tokens")):
        _fields(tok, f"{where}.tokens[{j}]", TokenDoc)
        if tok["committed_in"] < tok["sampled_in"]:
            raise ConfigError(
                f"{where}.tokens[{j}].committed_in must be >= sampled_in "
                f"({tok['sampled_in']}), got {tok['committed_in']}"
            )


def _filter(value: Any, where: str) -> None:
    parts = value.split("+") if isinstance(value, str) else [None]
    if any(p not in _FILTERS for p in parts):
        raise ConfigError(f"{where} must join {list(_FILTERS)} with '+', got {value!r}")


def _obj(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be an object, got {type(value).__name__}")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ConfigError(f"{where} must be a list, got {type(value).__name__}")
    return value


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "bool": (bool,),
    "float": (float, int),
}


def _fields(value: Any, where: str, kind: Any) -> None:
    """Every annotated field of the TypedDict ``kind`` is in ``value`` with a JSON value of
    its outer type (``int`` excludes ``bool``; ``X | None`` accepts ``null``)."""
    obj = _obj(value, where)
    for name, ann in kind.__annotations__.items():
        text = getattr(ann, "__forward_arg__", ann if isinstance(ann, str) else str(ann))
        if text.startswith("NotRequired["):
            if name not in obj:
                continue
            text = text[len("NotRequired["):-1]
        if name not in obj:
            raise ConfigError(f"{where}.{name} is missing")
        field = obj[name]
        if text.endswith("| None") and field is None:
            continue
        outer = text.split("|")[0].strip().split("[")[0]
        if outer in ("list", "dict"):
            ok = isinstance(field, list if outer == "list" else dict)
        elif outer in _JSON_TYPES:
            ok = isinstance(field, _JSON_TYPES[outer]) and not (
                outer != "bool" and isinstance(field, bool)
            )
        else:
            ok = isinstance(field, dict)
        if not ok:
            raise ConfigError(f"{where}.{name} must be {text}, got {field!r}")
