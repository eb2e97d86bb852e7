"""Engine: the round loop — schedule, execute, sample, commit — over injected components."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from deepinfer_kit.cache.protocols import KVCacheManager, wrapped_member
from deepinfer_kit.cache.tiers.config import KVRequestParams
from deepinfer_kit.engine.detokenizer import detokenizer_for
from deepinfer_kit.engine.failures import StepFailures
from deepinfer_kit.engine.inflight import InFlight, commit_round, launch_round
from deepinfer_kit.engine.protocols import Balancer, StepRunner, TwoPhaseRunner
from deepinfer_kit.engine.trace import StepTrace, make_trace
from deepinfer_kit.engine.groups import OutputGroups
from deepinfer_kit.engine.requests import RequestBuilder
from deepinfer_kit.errors import ConfigError, EngineDeadError, InvariantError
from deepinfer_kit.outputs import RequestOutput
from deepinfer_kit.overlap.protocols import OverlapExecutor
from deepinfer_kit.overlap.sync import SyncExecutor
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sched.protocols import DraftRoom, Scheduler

if TYPE_CHECKING:
    from deepinfer_kit.models.tokenizer import Tokenizer

__all__ = ["Engine"]


class Engine:
    """Serves requests in rounds over components passed in (any Protocol implementation).

    The user loop::

        engine.add_request("a", "Hello", SamplingParams(max_tokens=8))
        while engine.has_unfinished_requests():
            for out in engine.step():
                print(out.request_id, out.outputs[0].text)
        engine.flush()

    Failures stay with the requests they concern: a row whose logits are not finite ends
    that request with finish reason ``error``; a step whose execution or commit raises
    ends exactly that step's requests with ``error`` and frees their blocks, and the
    engine serves the rest (the completion's ``stop_reason`` holds the message). After
    ``max_failed_steps`` failed steps in a row, or when the scheduler cannot plan or
    fail a round, the engine is dead: every later call raises :class:`EngineDeadError`.

    Thread safety: ``add_request``, ``abort``, ``step`` and ``flush`` take one lock, so
    requests may be added or aborted from other threads while one thread steps.

    Args:
        runner: lays plans out for the device and executes them (any :class:`StepRunner`:
            a :class:`ModelRunner` in this process, a :class:`ProcessRunner` in a worker).
        scheduler: decides each round's work.
        cache: the scheduler's KV cache manager (read for traces and the idle check).
        tokenizer: encodes text prompts and decodes outputs; ``None`` for token ids only.
        vocab_size: prompt token ids must lie in ``[0, vocab_size)``.
        eos_token_id: the model's EOS id (``None``: stop only on stop ids / length).
        extra_eos_token_ids: further ids that end a generation like EOS (models with
            several); they act as stop token ids unless ``ignore_eos``.
        executor: runs each step's device work (default :class:`SyncExecutor`); depth 1
            (e.g. :class:`~deepinfer_kit.overlap.threaded.ThreadExecutor`) overlaps the
            host's scheduling of a round with the device work of the previous one.
        trace: called with a :class:`StepTrace` after every step, when given.
        max_logprobs: the most ``logprobs`` a request may ask for (``-1``: no cap).
        max_model_len: the scheduler's, for ``truncate_prompt_tokens`` (``None``: not checked here).
        max_failed_steps: failed steps in a row after which the engine is dead.
        tokenizer_note: why there is no tokenizer, quoted when a text prompt arrives.
        balancer: live EPLB (the runner feeds its window); rebalances run between rounds.
        num_draft: the most drafts the runner proposes per decode chunk (its speculation's
            γ; ``0``: none): the scheduler reserves room for them
            (:class:`~deepinfer_kit.sched.protocols.DraftRoom`).
        strict_components: the first failed step stops the engine, re-raising the failure
            (``EngineConfig.strict_components``).

    Raises:
        ConfigError: the runner's KV storage and the cache manager disagree on the block
            size or the number of blocks; an executor whose depth is not 0 or 1, or of
            depth 1 with a runner that has no token slots; ``num_draft`` with a scheduler
            that reserves no room for drafts.

    Speculation is the runner's (it drafts as each round executes, see
    :mod:`~deepinfer_kit.engine.runner.drafting`); the engine holds no speculation state.
    """

    def __init__(
        self,
        *,
        runner: StepRunner,
        scheduler: Scheduler,
        cache: KVCacheManager,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        eos_token_id: int | None,
        extra_eos_token_ids: Sequence[int] = (),
        executor: OverlapExecutor | None = None,
        trace: Callable[[StepTrace], None] | None = None,
        max_logprobs: int = 20,
        max_model_len: int | None = None,
        max_failed_steps: int = 8,
        tokenizer_note: str | None = None,
        balancer: Balancer | None = None,
        num_draft: int = 0,
        strict_components: bool = False,
    ) -> None:
        if (runner.block_size, runner.num_blocks) != (cache.block_size, cache.num_blocks):
            raise ConfigError(
                f"KV storage has {runner.num_blocks} blocks of {runner.block_size} tokens but the cache "
                f"manager has {cache.num_blocks} blocks of {cache.block_size}; build both from "
                f"one block_size and num_blocks"
            )
        self.runner = runner
        self.scheduler = scheduler
        self.cache = cache
        self.executor: OverlapExecutor = executor if executor is not None else SyncExecutor()
        if self.executor.depth not in (0, 1):
            raise ConfigError(
                f"executor depth must be 0 (synchronous) or 1 (overlapped), got "
                f"{self.executor.depth}"
            )
        if self.executor.depth and runner.token_slots is None:
            raise ConfigError(
                "an overlapped executor (depth 1) needs a runner with token_slots (placeholder "
                "inputs are gathered from them); build the runner with TokenSlots"
            )
        self._slots = runner.token_slots  # released as steps commit (see TokenSlots)
        # overlapped: steps go to the executor in two phases, so it may pipeline them
        self._two_phase = runner if self.executor.depth and isinstance(runner, TwoPhaseRunner) else None
        self.balancer = balancer
        self.num_draft = num_draft
        if num_draft:
            if not isinstance(scheduler, DraftRoom):
                raise ConfigError(
                    f"speculative decoding needs a scheduler with reserve_drafts() (the runner "
                    f"drafts into the room it plans); {type(scheduler).__name__} has none"
                )
            scheduler.reserve_drafts(num_draft)
        self._inflight: deque[InFlight] = deque()
        self._traces: list[Callable[[StepTrace], None]] = [trace] if trace is not None else []
        self._failures = StepFailures(max_failed_steps, strict=strict_components)
        self._builder = RequestBuilder(
            tokenizer, vocab_size, eos_token_id, extra_eos_token_ids, max_logprobs,
            scheduler.never_fits, tokenizer_note, max_model_len,
        )
        self._groups = OutputGroups(partial(detokenizer_for, tokenizer, pieces={}))
        self._lock = threading.RLock()
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self.num_cached_prompt_tokens = 0

    # ---- traces ------------------------------------------------------------------------

    def subscribe(self, callback: Callable[[StepTrace], None]) -> None:
        """Call ``callback`` with the :class:`StepTrace` of every step committed from now
        on, after the callbacks given before (``build_engine(trace=...)`` is the first).
        For readers that need the built engine (the viewer's recorder). Traced steps
        also return their MoE routing counts. Mutates the engine's list of callbacks."""
        with self._lock:
            self._traces.append(callback)

    @property
    def traced(self) -> bool:
        """Whether any trace callback is registered."""
        return bool(self._traces)

    # ---- requests ----------------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer | None:
        """Encodes text prompts and decodes outputs (``None``: token ids only)."""
        return self._builder.tokenizer

    @property
    def vocab_size(self) -> int:
        """Prompt token ids lie in ``[0, vocab_size)``."""
        return self._builder.vocab_size

    @property
    def eos_token_id(self) -> int | None:
        """The model's EOS id, stamped on every request."""
        return self._builder.eos_token_id

    def encode(self, prompt: str | Sequence[int]) -> tuple[list[int], str | None]:
        """Token ids (and text) of a prompt, validated; see :meth:`RequestBuilder.encode`.

        Raises:
            ConfigError: empty prompt, ids outside the vocabulary, or text without a
                tokenizer.
        """
        return self._builder.encode(prompt)

    def check_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
    ) -> None:
        """Validate a request without queueing it: every check :meth:`add_request` makes
        except the id's. Lets a caller validate a whole batch before queueing any of it.

        Raises:
            ConfigError: as :meth:`add_request`.
        """
        self._builder.build("check", prompt, params, priority, None)

    def add_request(
        self,
        request_id: str | None,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_context: Any = None,
        kv: KVRequestParams | dict[str, Any] | None = None,
    ) -> str:
        """Validate and queue a request; returns its id (generated when ``None``). ``kv``:
        its use of the KV tiers (:class:`~deepinfer_kit.cache.tiers.KVRequestParams`).

        Raises:
            ConfigError: bad prompt (see :meth:`encode`), bad params type, ``logprobs``
                above ``max_logprobs``, a non-int ``priority``, an id that is still live,
                or a request the scheduler says can never run (its prompt reaches
                ``max_model_len``, its KV exceeds the pool, ...; the message names the
                limit). Nothing is queued then; other requests are unaffected.
            EngineDeadError: the engine is dead.
        """
        kv_params = KVRequestParams.coerce(kv)
        with self._lock:
            self._failures.check_alive()
            rid = self._groups.claim(request_id)
            request = self._builder.build(self._groups.scheduler_id(rid), prompt, params, priority, cache_context)
            request.kv_params = kv_params
            self._groups.open(rid, request)
            try:
                self.scheduler.add(request)
            except BaseException:
                self._groups.discard(rid)
                raise
            self.num_prompt_tokens += request.num_prompt_tokens
            return rid

    def abort(self, request_id: str) -> bool:
        """Abort a request and all its completions; its output (reason ``abort``) comes
        from the next :meth:`step`, and the id may be reused at once. Its blocks are freed
        now (a model drafter's blocks of it when the runner's next round, or idle check,
        finds it gone). Returns False for an unknown or finished id."""
        with self._lock:
            sid = self._groups.close_live(request_id)
            if sid is None:
                return False
            return self.scheduler.abort(sid)  # the scheduler aborts fork children too

    def has_unfinished_requests(self) -> bool:
        """True while any request has not been reported finished."""
        return bool(len(self._groups)) or self.scheduler.has_unfinished()

    # ---- the round -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one round; returns the outputs its commit produced: every request whose
        completions all finished, and every request with ``output_kind`` CUMULATIVE or
        DELTA that produced tokens (its output so far, or what is new since its last
        output; ``finished`` False until the end). FINAL_ONLY requests (the default) are
        returned only when finished.

        Synchronous (executor depth 0): schedule, execute, commit this round. Overlapped
        (depth 1): schedule and launch this round, then commit the previous one while
        this one runs — a request's tokens are committed one step late, and a token
        sampled for a request that the previous round finished is discarded.

        A failure of the runner or the executor ends that round's requests with finish
        reason ``error`` (they are returned like any finished request) and the engine
        goes on. With EPLB on, a due rebalance runs first, between rounds.

        Raises:
            EngineDeadError: the scheduler could not plan (or fail) a round, or
                ``max_failed_steps`` steps failed in a row.
        """
        with self._lock:
            self._failures.check_alive()
            outputs = self._rebalance_if_due()
            t0 = time.perf_counter()
            free_before = self.cache.num_free_blocks
            evicted_before = self._evicted()
            try:
                plan = self.scheduler.schedule()
            except Exception as exc:
                raise self._failures.die("the scheduler failed to plan a round", exc) from exc
            launched = launch_round(self.runner, self.executor, self._failures, plan, bool(self._traces),
                                    self._two_phase)
            self._inflight.append(
                InFlight(plan, launched, free_before, evicted_before, t0, time.perf_counter())
            )
            while len(self._inflight) > self.executor.depth:
                outputs.extend(self._commit_oldest())
            return outputs

    def _rebalance_if_due(self) -> list[RequestOutput]:
        """A rebalance due: commit the rounds in flight (weights move between forwards only), then re-place."""
        balancer = self.balancer
        if balancer is None or not balancer.due():
            return []
        outputs = [out for _ in range(len(self._inflight)) for out in self._commit_oldest()]
        balancer.rebalance(in_flight=len(self._inflight))
        return outputs

    def flush(self) -> list[RequestOutput]:
        """Commit every round still in flight; returns their outputs, as :meth:`step`."""
        with self._lock:
            self._failures.check_alive()
            outputs: list[RequestOutput] = []
            while self._inflight:
                outputs.extend(self._commit_oldest())
            return outputs

    def run(self) -> list[RequestOutput]:
        """Step until every request finished; returns their outputs in finishing order."""
        outputs: list[RequestOutput] = []
        while self.has_unfinished_requests():
            outputs.extend(self.step())
        outputs.extend(self.flush())
        return outputs

    def close(self) -> None:
        """Release the executor's workers and the runner's (a worker process); rounds still
        in flight are dropped uncommitted (call :meth:`flush` first to keep them). Later
        calls raise :class:`EngineDeadError`. Idempotent."""
        with self._lock:
            self._inflight.clear()
            self.executor.close()
            self.runner.close()
            (wrapped_member(self.cache, "close") or (lambda: None))()  # a tiered cache's I/O threads
            if self._failures.dead is None:
                self._failures.dead = EngineDeadError("the engine was closed")

    def check_idle(self) -> None:
        """Raise :class:`InvariantError` unless no request and no block is held.

        Every block must be free or cached-evictable (reference count 0), every token
        slot free, and the cache manager's own integrity check must pass; a drafter
        with KV of its own (a draft model) must hold no sequence and no block either.
        """
        if self._inflight:
            raise InvariantError(f"{len(self._inflight)} rounds still in flight; call flush()")
        if len(self._groups) or self.scheduler.has_unfinished():
            raise InvariantError(f"engine holds requests: {self._groups.live_ids()}")
        free = self.cache.num_free_blocks
        if free != self.cache.num_blocks:
            raise InvariantError(
                f"{self.cache.num_blocks - free} blocks still referenced with no request live"
            )
        self.runner.check_idle()
        self.cache.check_integrity(())

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's name and contract): returns False,
        changing nothing, while a request is unfinished or a round is in flight; else
        empties the prefix index (:meth:`KVCacheManager.reset_prefix_cache`)."""
        with self._lock:
            if self._inflight or self.has_unfinished_requests():
                return False
            return self.cache.reset_prefix_cache()

    # ---- commit ------------------------------------------------------------------------

    def _commit_oldest(self) -> list[RequestOutput]:
        """Wait for the oldest round in flight and commit it (see :func:`commit_round`)."""
        entry = self._inflight.popleft()
        plan = entry.plan
        t1 = time.perf_counter()
        result, finished, t2 = commit_round(entry, self.executor, self.scheduler, self._failures)
        if self.balancer is not None and not plan.is_empty:  # the rebalance clock: committed rounds
            self.balancer.commit()
        if self._slots is not None:  # the step's device work is done: its leases may end
            self._slots.release_through(plan.step_id)
        outputs, cached = self._groups.collect(finished)
        self.num_cached_prompt_tokens += cached
        t3 = time.perf_counter()
        self.num_generated_tokens += sum(map(len, result.token_ids))
        if self._traces:
            trace = make_trace(
                plan, result, finished, (entry.free_before, self.cache.num_free_blocks),
                self._evicted() - entry.evicted_before,
                (entry.t0, entry.t1, entry.t1 + (t2 - t1), entry.t1 + (t3 - t1)),
                self._inflight[-1].plan.step_id if self._inflight else plan.step_id,
            )
            for callback in self._traces:
                callback(trace)
        return outputs

    # ---- helpers -------------------------------------------------------------------------

    def _evicted(self) -> int:
        stats = self.cache.stats
        return stats.evicted_blocks if stats is not None else 0
