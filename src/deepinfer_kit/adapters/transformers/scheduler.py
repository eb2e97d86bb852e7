"""KitScheduler: the kit's BatchScheduler and BlockKVCacheManager running as a scheduler
of transformers' continuous batching (``model.generate_batch``)."""

from __future__ import annotations

from typing import Any, Literal

import attrs
from transformers.generation.continuous_batching.requests import (
    FutureRequestState,
    RequestState,
    RequestStatus,
)
from transformers.generation.continuous_batching.scheduler import Scheduler

from deepinfer_kit.adapters._peers import check_peer_version
from deepinfer_kit.adapters.transformers.blocks import ClaimedBlocks
from deepinfer_kit.cache.manager import BlockKVCacheManager
from deepinfer_kit.cache.records import CacheConfig, PrefixCacheStats
from deepinfer_kit.errors import CapacityError, ConfigError, InvariantError
from deepinfer_kit.request import Request
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sched.batching import ContinuousBatching, StaticBatching
from deepinfer_kit.sched.records import ScheduledChunk, SchedulePlan, SchedulerConfig
from deepinfer_kit.sched.scheduler import BatchScheduler
from deepinfer_kit.step import StepResult

__all__ = ["KitScheduler", "TESTED_TRANSFORMERS"]

TESTED_TRANSFORMERS: tuple[str, ...] = ("5.24", "5.25")
"""transformers releases (version prefixes) this adapter was tested with."""

Batching = Literal["continuous", "static"]


class KitScheduler(Scheduler):
    """The kit's scheduler behind transformers' ``Scheduler`` interface.

    Each ``schedule_batch`` call first commits the previous round to the kit (the tokens
    transformers appended to each ``RequestState``), then plans one round with the kit's
    :class:`~deepinfer_kit.sched.BatchScheduler` — its batching policy, token budget,
    chunked prefill, prefix matching and preemption by recompute — and writes the plan
    into the states transformers lays out: ``position_offset`` (the chunk's start, past a
    prefix hit), ``tokens_to_process``, the status, and the block table (through
    :class:`ClaimedBlocks`). Blocks are the kit's: its manager owns reference counts,
    prefix identity and eviction, and publishes a block only after the round that wrote
    it was committed.

    Built by transformers as ``cls(cache=..., safety_margin=..., max_requests_per_batch=...)``
    through ``SCHEDULER_MAPPING``; register it with
    :func:`~deepinfer_kit.adapters.transformers.register` (which binds the kit options).

    Not covered (rejected with a ``ConfigError`` when a request or cache needs it):
    sliding-window layers, ``num_return_sequences > 1`` (forks), CPU offloading, async
    batching (``use_async_batching`` must be False), the block-table decode fast path
    (every round takes the varlen path). The kit keeps its prefix cache across calls only
    while the manager persists; ``reset`` starts a fresh one.

    Args:
        cache: transformers' ``PagedAttentionCache`` (full attention only); its pool is
            claimed whole by the kit.
        safety_margin: accepted for the interface; the kit's admission rule replaces it.
        max_requests_per_batch: caps ``config.max_num_seqs`` (lowered to it).
        config: the kit's round limits; default: ``max_num_seqs`` from
            ``max_requests_per_batch``, the budget from ``cache.max_batch_tokens``,
            ``max_model_len`` from the model config.
        batching: ``"continuous"`` or ``"static"``.
        prefix_caching: publish full blocks for reuse by later requests.
        index: the prefix index, ``"radix"`` or ``"hash"``.
        strict_version: raise on an untested transformers version.

    Raises:
        PeerVersionError: transformers' version is untested (with ``strict_version``).
        ConfigError: a bad option, or a budget beyond what transformers' batch holds.
    """

    def __init__(
        self,
        cache: Any,
        safety_margin: float | None,
        max_requests_per_batch: int,
        *,
        config: SchedulerConfig | None = None,
        batching: Batching = "continuous",
        prefix_caching: bool = True,
        index: Literal["radix", "hash"] = "radix",
        strict_version: bool = True,
    ) -> None:
        self.peer_version = check_peer_version(
            "transformers", TESTED_TRANSFORMERS, strict=strict_version
        )
        if batching not in ("continuous", "static"):
            raise ConfigError(f"batching must be 'continuous' or 'static', got {batching!r}")
        self._blocks = ClaimedBlocks(cache)
        max_batch_tokens = int(cache.max_batch_tokens)
        if config is None:
            max_len = getattr(cache.config, "max_position_embeddings", None) or 4096
            config = SchedulerConfig(
                max_num_seqs=min(256, max_requests_per_batch),
                max_num_batched_tokens=max_batch_tokens,
                max_model_len=int(max_len),
            )
        if config.max_num_batched_tokens > max_batch_tokens:
            raise ConfigError(
                f"config.max_num_batched_tokens must be <= the cache's max_batch_tokens "
                f"({max_batch_tokens}), got {config.max_num_batched_tokens}"
            )
        if config.max_num_seqs > max_requests_per_batch:
            # transformers sizes its batch for this many requests (it infers the number
            # from the workload when not configured): the kit's seats follow it.
            config = attrs.evolve(config, max_num_seqs=max_requests_per_batch)
        self.config = config
        self.batching: Batching = batching
        self._cache_config = CacheConfig(
            block_size=self._blocks.block_size,
            num_blocks=self._blocks.num_blocks,
            enable_prefix_caching=prefix_caching,
        )
        self._index: Literal["radix", "hash"] = index
        self.num_rounds = 0  # kit rounds planned
        self.num_batches = 0  # transformers batches handed over (>= rounds)
        self.num_preemptions = 0
        super().__init__(cache, 0.0 if safety_margin is None else safety_margin, max_requests_per_batch)

    # ---------------------------------------------------------------- lifecycle

    def reset(self) -> None:
        """Start a new generation loop: transformers' queues emptied, a fresh kit
        scheduler and manager (the prefix cache starts empty). Called by transformers
        before it frees the cache's requests, so no kit block reaches its pool."""
        super().reset()
        if not hasattr(self, "_blocks"):
            return  # the base constructor's call, before the kit parts exist
        self._blocks.unbind_all()
        self.manager = BlockKVCacheManager.create(self._cache_config, index=self._index)
        policy = ContinuousBatching() if self.batching == "continuous" else StaticBatching()
        self.kit = BatchScheduler(self.config, self.manager, policy)
        self._states: dict[str, RequestState] = {}
        self._done: set[str] = set()
        self._inflight: SchedulePlan | None = None
        self._queue: list[ScheduledChunk] = []  # chunks of _inflight not handed over yet, last first

    def add_waiting_request(self, state: RequestState) -> None:
        """Queue ``state`` in transformers' waiting list and a mirror request in the kit.

        Raises:
            ConfigError: the request forks (``num_children > 0``), has an empty prompt or
                no ``max_new_tokens``, or can never run under the kit's limits (the reason names the limit);
                transformers then fails that request alone.
        """
        rid = state.request_id
        if state.num_children > 0:
            raise ConfigError(
                f"num_return_sequences must be 1 with the kit scheduler, request {rid!r} "
                f"asks for {state.num_children + 1}"
            )
        prompt = list(state.initial_tokens)
        if not prompt:
            raise ConfigError(f"prompt of request {rid!r} must not be empty")
        limit = state.max_new_tokens
        if limit is None:
            raise ConfigError(f"max_new_tokens of request {rid!r} must be set with the kit scheduler, got None")
        if len(prompt) + limit > self.config.max_model_len:
            raise ConfigError(
                f"prompt ({len(prompt)} tokens) plus max_new_tokens ({limit}) of request "
                f"{rid!r} must be <= max_model_len={self.config.max_model_len}"
            )
        params = SamplingParams(
            temperature=0.0,
            max_tokens=limit,
            stop_token_ids=tuple(sorted(state._eos_token_ids)),
        )
        req = Request(rid, prompt, params)
        reason = self.kit.never_fits(req)
        if reason is not None:
            raise ConfigError(f"request {rid!r} can never run: {reason}")
        self.kit.add(req)
        self._states[rid] = state
        super().add_waiting_request(state)

    def finish_request(self, request_id: str) -> None:
        """transformers finished (or failed) ``request_id``: forget its table; the kit
        frees its blocks after committing the round that produced its last token."""
        self.active_requests.pop(request_id, None)
        self._blocks.unbind(request_id)
        self._done.add(request_id)

    def clear_cancelled_requests(self) -> list[RequestState]:
        """Remove cancelled requests from both queues; the kit aborts them (freeing their
        blocks) once the round in flight is committed. Returns their states."""
        cancelled: list[RequestState] = []
        with self._cancellation_lock:
            for rid in self._requests_to_cancel:
                state = self.active_requests.pop(rid, None) or self.waiting_requests.pop(rid, None)
                if state is not None:
                    cancelled.append(state)
                if rid in self.waiting_requests_order:
                    self.waiting_requests_order.remove(rid)
                self._blocks.unbind(rid)
                self._done.add(rid)
            self._requests_to_cancel = set()
        return cancelled

    def has_pending_requests(self) -> bool:
        """True while transformers holds active or waiting requests. When it holds none,
        the last round is committed and the kit is checked idle (every block back).

        Raises:
            InvariantError: the kit still holds a request or a block once idle.
        """
        if self.active_requests or self.waiting_requests:
            return True
        self._commit_inflight()
        if self.kit.has_unfinished():  # only aborts left to report: one empty round
            self.kit.commit(self.kit.schedule(), StepResult(token_ids=[]))
        if self.kit.has_unfinished():
            raise InvariantError(
                f"kit scheduler holds {self.kit.num_unfinished} requests after transformers "
                f"finished them all"
            )
        self.manager.check_integrity(())
        return False

    # ---------------------------------------------------------------- the round

    def schedule_batch(
        self, token_budget: int, cache_budget: int
    ) -> tuple[list[FutureRequestState] | None, bool, int, int]:
        """Hand transformers the next batch: the rest of the kit's current round, or —
        once that round ran whole — commit it and plan the next one with the kit.

        A round whose chunks together read more cached KV than ``cache_budget`` (many
        requests over one long shared prefix) is handed over in several batches, each
        within the budget; chunks of one round are independent, so the tokens are those
        of a single forward. Returns ``(futures, False, num_query_tokens,
        kv_tokens_read)`` as transformers' schedulers do; the decode fast path is never
        taken.

        Raises:
            ConfigError: ``token_budget`` is below the kit's round budget.
            CapacityError: one chunk alone reads more cached KV than ``cache_budget``.
        """
        if token_budget < self.config.max_num_batched_tokens:
            raise ConfigError(
                f"token_budget must be >= config.max_num_batched_tokens "
                f"({self.config.max_num_batched_tokens}), got {token_budget}"
            )
        if not self._queue:
            self._commit_inflight()
            plan = self.kit.schedule()
            self.num_rounds += 1
            self.num_preemptions += len(plan.preempted_ids)
            for rid in plan.preempted_ids:
                self._blocks.unbind(rid)
            self._blocks.copy(plan.block_copies)
            if plan.is_empty:
                self.kit.commit(plan, StepResult(token_ids=[]))
                return [], False, 0, 0
            self._inflight = plan
            self._queue = list(reversed(plan.all_chunks()))
        return self._hand_over(cache_budget)

    def _hand_over(self, cache_budget: int) -> tuple[list[FutureRequestState], bool, int, int]:
        """Write the queued chunks that fit ``cache_budget`` (at least one) into their
        states and block tables; return them as transformers' batch."""
        futures: list[FutureRequestState] = []
        queue = self._queue
        num_q = kv_read = 0
        while queue and (not futures or kv_read + queue[-1].start <= cache_budget):
            chunk = queue.pop()
            rid = chunk.request_id
            if rid in self._done:
                continue  # cancelled since the round was planned
            if chunk.start > cache_budget:
                raise CapacityError(
                    f"request {rid!r} reads {chunk.start} cached KV tokens, more than "
                    f"transformers' cache_budget={cache_budget}"
                )
            state = self._states[rid]
            if self.waiting_requests.pop(rid, None) is not None:
                self.waiting_requests_order.remove(rid)
                self.active_requests[rid] = state
            prompt = state.initial_tokens
            end = chunk.start + chunk.num_tokens
            state.position_offset = chunk.start
            state.tokens_to_process = list(chunk.token_ids)
            state.remaining_prefill_tokens = prompt[end:] if end < len(prompt) else []
            state.status = RequestStatus.DECODING if chunk.sample else RequestStatus.PREFILLING
            self._blocks.bind(rid, chunk.block_table)
            kv_read += chunk.start
            num_q += chunk.num_tokens
            futures.append(FutureRequestState(state, chunk.sample, {}, chunk.num_tokens))
        self.num_batches += 1
        return futures, False, num_q, kv_read

    def _commit_inflight(self) -> None:
        """Commit the round transformers just ran: each sampling chunk's token is the one
        transformers appended at the chunk's output position. A request cancelled before
        its chunk ran is aborted first (its chunk is then ignored); every other request
        transformers finished or cancelled is aborted after the commit, so the blocks of
        its last round are published first.

        Raises:
            InvariantError: a chunk that ran has no token (transformers updated the
                batch out of order: ``use_async_batching=True`` is not covered).
        """
        plan = self._inflight
        self._inflight = None
        self._queue = []
        done = self._done
        if plan is not None:
            tokens: list[list[int]] = []
            for chunk in plan.all_chunks():
                rid = chunk.request_id
                out = self._states[rid].generated_tokens
                pos = chunk.output_position
                if not chunk.sample:
                    tokens.append([])
                elif pos < len(out):
                    tokens.append([out[pos]])
                elif rid in done:
                    self.kit.abort(rid)  # cancelled before its chunk ran
                    tokens.append([])
                else:
                    raise InvariantError(
                        f"request {rid!r} has no token at output position {pos} after its "
                        f"round ran; the kit's scheduler needs use_async_batching=False"
                    )
            for result in self.kit.commit(plan, StepResult(token_ids=tokens)):
                rid = result.request_id
                if rid not in done and rid in self.active_requests:
                    raise InvariantError(
                        f"the kit finished request {rid!r} ({result.outputs[0].finish_reason}) "
                        f"while transformers still runs it: their stop rules disagree"
                    )
        for rid in done:
            self.kit.abort(rid)  # False when the kit's own stop rule already ended it
            self._states.pop(rid, None)
        done.clear()

    # ---------------------------------------------------------------- introspection

    @property
    def prefix_stats(self) -> PrefixCacheStats | None:
        """A snapshot of the kit's prefix-cache counters (``None`` with caching off)."""
        stats = self.manager.stats
        if stats is None:
            return None
        return PrefixCacheStats(
            stats.queries, stats.query_blocks, stats.hit_blocks, stats.inserted_blocks, stats.evicted_blocks
        )
