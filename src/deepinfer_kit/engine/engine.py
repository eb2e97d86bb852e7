"""Engine: the round loop — schedule, execute, sample, commit — over injected components."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from deepinfer_kit.cache.protocols import KVCacheManager
from deepinfer_kit.engine.runner import ModelRunner
from deepinfer_kit.engine.trace import StepTrace, TracedChunk
from deepinfer_kit.errors import ConfigError, InvariantError
from deepinfer_kit.outputs import CompletionOutput, RequestOutput
from deepinfer_kit.overlap.protocols import OverlapExecutor
from deepinfer_kit.overlap.sync import SyncExecutor
from deepinfer_kit.request import Request
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sample.protocols import Sampler
from deepinfer_kit.sched.protocols import Scheduler
from deepinfer_kit.sched.records import SchedulePlan, StepResult

if TYPE_CHECKING:
    from deepinfer_kit.engine.build import SchedulerFactory
    from deepinfer_kit.engine.config import EngineConfig
    from deepinfer_kit.models.tokenizer import Tokenizer

__all__ = ["Engine"]


@attrs.define(slots=True, eq=False)
class _Group:
    """The completions of one user request (``n`` of them) gathered until all finish."""

    request: Request
    n: int
    completions: dict[int, CompletionOutput] = attrs.field(factory=dict)
    num_cached_tokens: int = 0


class Engine:
    """Serves requests in rounds over components passed in (any Protocol implementation).

    The user loop::

        engine.add_request("a", "Hello", SamplingParams(max_tokens=8))
        while engine.has_unfinished_requests():
            for out in engine.step():
                print(out.request_id, out.outputs[0].text)
        engine.flush()

    Args:
        runner: lays plans out for the device and executes them.
        scheduler: decides each round's work.
        cache: the scheduler's KV cache manager (read for traces and the idle check).
        tokenizer: encodes text prompts and decodes outputs; ``None`` for token ids only.
        vocab_size: prompt token ids must lie in ``[0, vocab_size)``.
        max_model_len: a prompt must be shorter than this.
        eos_token_id: the model's EOS id (``None``: stop only on stop ids / length).
        extra_eos_token_ids: further ids that end a generation like EOS (models with
            several); they act as stop token ids unless ``ignore_eos``.
        executor: runs each step's device work (default :class:`SyncExecutor`).
        trace: called with a :class:`StepTrace` after every step, when given.
    """

    def __init__(
        self,
        *,
        runner: ModelRunner,
        scheduler: Scheduler,
        cache: KVCacheManager,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        max_model_len: int,
        eos_token_id: int | None,
        extra_eos_token_ids: Sequence[int] = (),
        executor: OverlapExecutor | None = None,
        trace: Callable[[StepTrace], None] | None = None,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.cache = cache
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.extra_eos_token_ids = tuple(extra_eos_token_ids)
        self.executor: OverlapExecutor = executor if executor is not None else SyncExecutor()
        if self.executor.depth != 0:
            raise ConfigError(
                f"executor depth must be 0 for this engine (no placeholder resolution yet), "
                f"got {self.executor.depth}"
            )
        self.trace = trace
        self._groups: dict[str, _Group] = {}
        self._ids = itertools.count()
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self.num_cached_prompt_tokens = 0

    @classmethod
    def from_config(
        cls,
        config: EngineConfig | None = None,
        *,
        make_scheduler: SchedulerFactory | None = None,
        sampler: Sampler | None = None,
        executor: OverlapExecutor | None = None,
        **overrides: Any,
    ) -> Engine:
        """Build the default components described by ``config``; ``overrides`` replace
        config fields, and ``make_scheduler`` / ``sampler`` / ``executor`` replace a
        default component with yours (see :func:`~deepinfer_kit.engine.build.build_engine`).
        """
        from deepinfer_kit.engine.build import build_engine
        from deepinfer_kit.engine.config import EngineConfig

        cfg = config if config is not None else EngineConfig()
        if overrides:
            cfg = attrs.evolve(cfg, **overrides)
        return build_engine(cfg, make_scheduler=make_scheduler, sampler=sampler, executor=executor)

    # ---- requests ----------------------------------------------------------------------

    def encode(self, prompt: str | Sequence[int]) -> tuple[list[int], str | None]:
        """Token ids (and text) of a prompt, validated.

        Raises:
            ConfigError: empty prompt, ids outside the vocabulary, text without a
                tokenizer, or a prompt not shorter than ``max_model_len``.
        """
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("prompt is text but the engine has no tokenizer; pass token ids")
            text: str | None = prompt
            ids = self.tokenizer.encode(prompt)
        else:
            text = None
            ids = list(prompt)
        if not ids:
            raise ConfigError(f"prompt must not be empty, got {prompt!r}")
        for tok in ids:
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < self.vocab_size:
                raise ConfigError(
                    f"prompt token ids must be ints in [0, {self.vocab_size}), got {tok!r}"
                )
        if len(ids) >= self.max_model_len:
            raise ConfigError(
                f"prompt has {len(ids)} tokens; it must be shorter than "
                f"max_model_len={self.max_model_len}"
            )
        return ids, text

    def add_request(
        self,
        request_id: str | None,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_context: Any = None,
    ) -> str:
        """Validate and queue a request; returns its id (generated when ``None``).

        Raises:
            ConfigError: bad prompt (see :meth:`encode`), bad params type, or an id that is
                still live. Nothing is queued then; other requests are unaffected.
        """
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ConfigError(f"params must be SamplingParams, got {type(params).__name__}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if not isinstance(rid, str) or not rid:
            raise ConfigError(f"request_id must be a non-empty str, got {rid!r}")
        if rid in self._groups:
            raise ConfigError(f"request_id {rid!r} is already in use by a live request")
        ids, text = self.encode(prompt)
        if self.extra_eos_token_ids and not params.ignore_eos:
            extra = tuple(t for t in self.extra_eos_token_ids if t not in params.stop_token_ids)
            params = attrs.evolve(params, stop_token_ids=params.stop_token_ids + extra)
        request = Request(
            request_id=rid,
            prompt_token_ids=ids,
            params=params,
            arrival_time=time.monotonic(),
            eos_token_id=self.eos_token_id,
            priority=priority,
            prompt_text=text,
            cache_context=cache_context,
        )
        self.scheduler.add(request)
        self._groups[rid] = _Group(request=request, n=params.n)
        self.num_prompt_tokens += len(ids)
        return rid

    def abort(self, request_id: str) -> bool:
        """Abort a request and all its completions; its output (reason ``abort``) comes
        from the next :meth:`step`. Returns False for an unknown or finished id."""
        if request_id not in self._groups:
            return False
        return self.scheduler.abort(request_id)  # the scheduler aborts fork children too

    def has_unfinished_requests(self) -> bool:
        """True while any request has not been reported finished."""
        return bool(self._groups) or self.scheduler.has_unfinished()

    # ---- the round -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one round; returns the requests that finished in it (all completions)."""
        t0 = time.perf_counter()
        free_before = self.cache.num_free_blocks
        evicted_before = self._evicted()
        plan = self.scheduler.schedule()
        held = [len(c.request.block_table) for c in plan.chunks] if self.trace is not None else []
        t1 = time.perf_counter()
        if plan.chunks:
            prepared = self.runner.prepare(plan)
            pending = self.executor.launch(plan.step_id, lambda: self.runner.execute(prepared))
            result = self.executor.wait(pending)
        else:
            result = StepResult(token_ids=[])
        t2 = time.perf_counter()
        finished = self.scheduler.commit(plan, result)
        outputs = self._collect(finished)
        t3 = time.perf_counter()
        self.num_generated_tokens += sum(len(t) for t in result.token_ids)
        if self.trace is not None:
            self.trace(
                self._make_trace(plan, result, finished, held, free_before, evicted_before, (t0, t1, t2, t3))
            )
        return outputs

    def flush(self) -> list[RequestOutput]:
        """Commit whatever is in flight (nothing, with a synchronous executor)."""
        return []

    def run(self) -> list[RequestOutput]:
        """Step until every request finished; returns their outputs in finishing order."""
        outputs: list[RequestOutput] = []
        while self.has_unfinished_requests():
            outputs.extend(self.step())
        outputs.extend(self.flush())
        return outputs

    def check_idle(self) -> None:
        """Raise :class:`InvariantError` unless no request and no block is held.

        Every block must be free or cached-evictable (reference count 0).
        """
        if self._groups or self.scheduler.has_unfinished():
            raise InvariantError(f"engine holds requests: {sorted(self._groups)}")
        free = self.cache.num_free_blocks
        if free != self.cache.num_blocks:
            raise InvariantError(
                f"{self.cache.num_blocks - free} blocks still referenced with no request live"
            )
        check = getattr(self.cache, "check_integrity", None)
        if callable(check):
            check()

    # ---- helpers -------------------------------------------------------------------------

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    def _collect(self, finished: list[RequestOutput]) -> list[RequestOutput]:
        """Merge finished sequences into their user request; emit requests whose every
        completion finished."""
        done: list[RequestOutput] = []
        for out in finished:
            group = self._groups.get(out.request_id)
            if group is None:
                continue
            for completion in out.outputs:
                completion.text = self._decode(completion.token_ids)
                group.completions[completion.index] = completion
            if out.outputs and out.outputs[0].index == 0:
                group.num_cached_tokens = out.num_cached_tokens
            first = group.completions.get(0)
            never_forked = (
                first is not None
                and first.finish_reason in ("abort", "error")
                and len(group.completions) < group.n
                and not first.token_ids
            )
            if never_forked:
                assert first is not None
                for i in range(group.n):
                    group.completions.setdefault(
                        i, attrs.evolve(first, index=i, token_ids=[], text="")
                    )
            if len(group.completions) == group.n:
                del self._groups[out.request_id]
                self.num_cached_prompt_tokens += group.num_cached_tokens
                req = group.request
                done.append(
                    RequestOutput(
                        request_id=req.request_id,
                        prompt=req.prompt_text,
                        prompt_token_ids=list(req.prompt_token_ids),
                        outputs=[group.completions[i] for i in range(group.n)],
                        finished=True,
                        num_cached_tokens=group.num_cached_tokens,
                        metrics=out.metrics,
                    )
                )
        return done

    def _evicted(self) -> int:
        stats = getattr(self.cache, "stats", None)
        return int(getattr(stats, "evicted_blocks", 0))

    def _make_trace(
        self,
        plan: SchedulePlan,
        result: StepResult,
        finished: list[RequestOutput],
        held: list[int],
        free_before: int,
        evicted_before: int,
        times: tuple[float, float, float, float],
    ) -> StepTrace:
        chunks = []
        for i, chunk in enumerate(plan.chunks):
            req = chunk.request
            admitted = chunk.start == req.num_cached_tokens and req.num_cached_tokens > 0
            sampled = result.token_ids[i] if i < len(result.token_ids) else []
            chunks.append(
                TracedChunk(
                    request_id=req.request_id,
                    kind="prefill" if chunk.is_prefill else "decode",
                    start=chunk.start,
                    num_tokens=chunk.num_tokens,
                    num_cached_tokens=req.num_cached_tokens if admitted else 0,
                    sampled=tuple(sampled),
                    num_blocks=held[i],
                )
            )
        counts = self.runner.model.expert_counts() if plan.chunks else None
        t0, t1, t2, t3 = times
        return StepTrace(
            step_id=plan.step_id,
            chunks=tuple(chunks),
            num_batched_tokens=plan.num_batched_tokens,
            token_budget=plan.token_budget,
            free_blocks_before=free_before,
            free_blocks_after=self.cache.num_free_blocks,
            blocks_evicted=self._evicted() - evicted_before,
            prefix_hit_tokens=plan.num_cached_tokens,
            block_copies=len(plan.block_copies),
            preempted=tuple(plan.preempted_ids),
            finished=tuple(
                f"{o.request_id}#{c.index}" if c.index else o.request_id
                for o in finished
                for c in o.outputs
            ),
            expert_counts=tuple(tuple(row) for row in counts.tolist()) if counts is not None else None,
            schedule_s=t1 - t0,
            execute_s=t2 - t1,
            commit_s=t3 - t2,
        )
