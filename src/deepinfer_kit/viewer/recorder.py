"""TraceRecorder: builds a trace document (schema.py) from a real engine run, step by step."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from deepinfer_kit.cache.protocols import BlockAllocator, PrefixIndex
from deepinfer_kit.engine.trace import StepTrace, TracedChunk
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.request import Request
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.viewer.eplb_view import EplbView
from deepinfer_kit.viewer.schema import (
    SCHEMA_NAME,
    SCHEMA_VERSION,
    BlocksDoc,
    CandidateDoc,
    ChunkDoc,
    RequestDoc,
    SampleDoc,
    StepDoc,
    TokenDoc,
    TraceDoc,
    dumps,
)

if TYPE_CHECKING:
    from deepinfer_kit.engine.engine import Engine

__all__ = ["TraceRecorder", "QueueView", "PoolView", "filter_name"]


@runtime_checkable
class QueueView(Protocol):
    """A scheduler whose queues can be read (the project's schedulers are)."""

    @property
    def running(self) -> Sequence[Request]:
        """Running sequences in scheduling order (read only)."""
        ...

    @property
    def waiting(self) -> Sequence[Request]:
        """Waiting sequences (new and preempted) in admission order (read only)."""
        ...


@runtime_checkable
class PoolView(Protocol):
    """A KV cache manager whose allocator and prefix index can be read."""

    @property
    def allocator(self) -> BlockAllocator:
        """The block pool (read only)."""
        ...

    @property
    def index(self) -> PrefixIndex | None:
        """The prefix index, or ``None`` when prefix caching is off (read only)."""
        ...


def filter_name(params: SamplingParams) -> str:
    """Which filters shape a draw under ``params``: ``"greedy"``, or ``"temperature"``
    joined by ``+`` with ``top-k``, ``top-p`` and ``min-p`` when each is active. Pure."""
    if params.is_greedy:
        return "greedy"
    parts = ["temperature"]
    if params.uses_top_k:
        parts.append("top-k")
    if params.top_p < 1.0:
        parts.append("top-p")
    if params.min_p > 0.0:
        parts.append("min-p")
    return "+".join(parts)


class TraceRecorder:
    """Collects each step of an engine run with the state it left, as a trace document.

    Use it as the engine's trace callback; :meth:`attach` installs it (keeping any
    callback already there, which still receives every :class:`StepTrace`)::

        recorder = TraceRecorder.attach(engine)
        engine.add_request("a", "Hello", SamplingParams(max_tokens=8, logprobs=5))
        engine.run()
        write_html(recorder, "run.html")

    Each call reads, at that moment (after the step committed), the scheduler's waiting
    and running queues, every running sequence's block table, each physical block's
    reference count and whether the prefix index caches it; with live EPLB, the placement
    the step ran under, its per-slot counts and any rebalance just before it. Reads only: the engine runs
    exactly as it would untraced. Cost per step: O(num_blocks + tokens in the step).

    Args:
        engine: the engine to follow; its scheduler must offer ``running`` / ``waiting``
            (:class:`QueueView`), its cache ``allocator`` / ``index`` (:class:`PoolView`).
        model: a label for the run (stored in ``meta.model``).

    Raises:
        ConfigError: the scheduler or the cache manager cannot be read that way.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        model: str = "",
    ) -> None:
        scheduler, cache = engine.scheduler, engine.cache
        if not isinstance(scheduler, QueueView):
            raise ConfigError(
                f"engine.scheduler must expose running and waiting queues, got {type(scheduler).__name__}"
            )
        if not isinstance(cache, PoolView):
            raise ConfigError(
                f"engine.cache must expose allocator and index, got {type(cache).__name__}"
            )
        self._queues: QueueView = scheduler
        self._pool: PoolView = cache
        self._engine = engine
        self._doc: TraceDoc = {
            "schema": SCHEMA_NAME,
            "version": SCHEMA_VERSION,
            "meta": {
                "model": model,
                "block_size": cache.block_size,
                "num_blocks": cache.num_blocks,
                "max_num_seqs": 0,
                "overlap": engine.executor.depth > 0,
                "speculative": engine.num_draft > 0,
            },
            "requests": {},
            "steps": [],
        }
        self._doc["meta"]["max_num_seqs"] = _max_num_seqs(scheduler)
        self._eplb = EplbView(engine.balancer) if engine.balancer is not None else None
        if self._eplb is not None:
            self._doc["meta"]["eplb"] = self._eplb.meta()
        self._traces: list[StepTrace] = []
        self._finished: list[str] = []
        self._num_outputs: dict[str, int] = {}
        self._seqs: dict[str, Request] = {}  # live sequences seen in the queues
        self._cached: set[int] = set()

    @classmethod
    def attach(cls, engine: Engine, *, model: str = "") -> TraceRecorder:
        """A recorder subscribed to ``engine``'s step traces (:meth:`Engine.subscribe`,
        after the callbacks already there). Raises ConfigError as the constructor does."""
        recorder = cls(engine, model=model)
        engine.subscribe(recorder)
        return recorder

    @property
    def traces(self) -> list[StepTrace]:
        """The :class:`StepTrace` records received, in commit order (read only)."""
        return self._traces

    def document(self) -> TraceDoc:
        """The trace document so far (the recorder's own object; copy before mutating)."""
        return self._doc

    def to_json(self, indent: int | None = None) -> str:
        """The document as JSON text (validated; see :func:`schema.dumps`)."""
        return dumps(self._doc, indent=indent)

    def __call__(self, trace: StepTrace) -> None:
        """Record one step; called by the engine after the step committed. Appends to the
        document."""
        self._traces.append(trace)
        for request in (*self._queues.running, *self._queues.waiting):
            rid = request.request_id
            self._register(rid, request.params, len(request.prompt_token_ids), request.parent_id)
            if self._seqs.get(rid) is not request:  # a new sequence (or a reused id)
                self._seqs[rid] = request
                self._num_outputs[rid] = 0
        sampling: list[SampleDoc] = []
        tokens: list[TokenDoc] = []
        for chunk in trace.chunks:
            self._sampled(chunk, trace, sampling, tokens)
        self._finished.extend(trace.finished)
        for rid in trace.finished:
            self._seqs.pop(rid, None)
        step: StepDoc = {
            "step": trace.step_id,
            "committed_in": trace.committed_in,
            "budget": trace.token_budget,
            "batched_tokens": trace.num_batched_tokens,
            "queues": {
                "waiting": [r.request_id for r in self._queues.waiting],
                "running": [r.request_id for r in self._queues.running],
                "finished": list(self._finished),
            },
            "chunks": [_chunk_doc(c) for c in trace.chunks],
            "preempted": list(trace.preempted),
            "finished": list(trace.finished),
            "blocks": self._blocks(trace),
            "sampling": sampling,
            "tokens": tokens,
            "experts": [list(row) for row in trace.expert_counts]
            if trace.expert_counts is not None else None,
        }
        if self._eplb is not None:
            step["eplb"] = self._eplb.step(trace.slot_counts, trace.expert_counts)
        self._doc["steps"].append(step)

    # ---- pieces ---------------------------------------------------------------------

    def _register(self, rid: str, params: SamplingParams, prompt_len: int, parent: str | None) -> None:
        if rid not in self._doc["requests"]:
            entry: RequestDoc = {
                "prompt_len": prompt_len,
                "parent": parent,
                "n": params.n,
                "filter": filter_name(params),
                "logprobs": params.logprobs,
            }
            self._doc["requests"][rid] = entry

    def _sampled(self, chunk: TracedChunk, trace: StepTrace, sampling: list[SampleDoc],
                 tokens: list[TokenDoc]) -> None:
        """The draws of one chunk and the tokens they committed. A fork's first sample
        gives draw ``i`` to completion ``i``; a verified chunk's draws all go to its one
        sequence. What was committed is read from the sequence itself (its new output
        tokens): a commit drops draws for a sequence preempted or finished since the
        step was scheduled, and the drafts after a stop inside an accepted run."""
        if not chunk.sampled or chunk.row is None:
            return
        params = chunk.row.params
        rid = chunk.request_id
        fork = chunk.num_drafted == 0 and len(chunk.sampled) > 1
        shares = ([(f"{rid}#{i}" if i else rid, [t]) for i, t in enumerate(chunk.sampled)]
                  if fork else [(rid, list(chunk.sampled))])
        position = 0
        for owner, drawn in shares:
            self._register(owner, params, len(chunk.row.prompt_token_ids), rid if owner != rid else None)
            index = self._num_outputs.get(owner, 0)
            seq = self._seqs.get(owner)
            kept = drawn if seq is None else list(seq.output_token_ids[index:index + len(drawn)])
            self._num_outputs[owner] = index + len(kept)
            for j, token in enumerate(drawn):
                committed = j < len(kept)
                if committed:
                    tokens.append({"request": owner, "index": index + j, "token": token,
                                   "sampled_in": trace.step_id, "committed_in": trace.committed_in})
                cands = chunk.candidates[position] if position < len(chunk.candidates) else ()
                position += 1
                sampling.append({
                    "request": owner,
                    "token": token,
                    "text": self._text(token),
                    "filter": filter_name(params),
                    "committed": committed,
                    "candidates": [self._candidate(t, lp, rank) for t, lp, rank in cands],
                })

    def _candidate(self, token: int, logprob: float, rank: int) -> CandidateDoc:
        return {"token": token, "text": self._text(token),
                "logprob": round(logprob, 6) if math.isfinite(logprob) else None, "rank": rank}

    def _text(self, token: int) -> str:
        """The token's text alone, or ``""`` when it has none (no tokenizer, or a piece
        such as a lone byte of a multi-byte character that decodes to U+FFFD)."""
        tokenizer = self._engine.tokenizer
        text = tokenizer.decode([token]) if tokenizer is not None else ""
        return "" if "\ufffd" in text else text

    def _blocks(self, trace: StepTrace) -> BlocksDoc:
        """The pool as the step left it, read through the allocator and the index."""
        allocator, index = self._pool.allocator, self._pool.index
        refs = [allocator.ref_count(b) for b in range(allocator.num_blocks)]
        cached = {b for b in range(allocator.num_blocks) if index is not None and index.contains(b)}
        evicted = sorted(self._cached - cached)
        self._cached = cached
        P = allocator.block_size
        doc: BlocksDoc = {
            "tables": {r.request_id: list(r.block_table) for r in self._queues.running},
            "ref_counts": refs,
            "cached": sorted(cached),
            "shared": [b for b, n in enumerate(refs) if n > 1],
            "copies": [[src, dst] for src, dst in trace.copied_blocks],
            "prefix_hits": {
                c.request_id: list(c.block_table[: c.num_cached_tokens // P])
                for c in trace.chunks if c.num_cached_tokens
            },
            "evicted": evicted,
            "num_evicted": trace.blocks_evicted,
            "num_free": self._engine.cache.num_free_blocks,
        }
        window_blocks = getattr(self._pool, "window_blocks", None)  # a cache with sliding-window groups
        if window_blocks is not None:
            doc["windows"] = {r.request_id: window_blocks(r) for r in self._queues.running}
        return doc


def _chunk_doc(chunk: TracedChunk) -> ChunkDoc:
    return {
        "request": chunk.request_id,
        "kind": chunk.kind,
        "start": chunk.start,
        "q": chunk.num_tokens,
        "cached": chunk.num_cached_tokens,
        "sampled": list(chunk.sampled),
        "drafted": list(chunk.drafted),
        "verified": chunk.num_drafted,
        "accepted": chunk.num_accepted,
    }


def _max_num_seqs(scheduler: object) -> int:
    """``max_num_seqs`` of a scheduler that exposes its config, else 0 (unknown)."""
    config = getattr(scheduler, "config", None)
    value = getattr(config, "max_num_seqs", 0)
    return value if isinstance(value, int) else 0
