"""ModelRunner: turns a SchedulePlan into device tensors, runs the forward and samples."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from deepinfer_kit._staging import to_device
from deepinfer_kit.engine.runner.prepared import PreparedStep
from deepinfer_kit.engine.runner.layout import lay_out
from deepinfer_kit.models.packing import pack_inputs, unpack_inputs, unpack_tail
from deepinfer_kit.engine.runner.launched import LaunchedStep
from deepinfer_kit.engine.runner.step_outputs import chunk_results, copy_back, finite_rows, host_rows, logprob_maps
from deepinfer_kit.engine.runner.grammar_stage import GrammarStage
from deepinfer_kit.engine.runner.token_slots import UNSAMPLED
from deepinfer_kit.spec.verify.step import verify_round
from deepinfer_kit.sample.logprobs import attach_logprobs
from deepinfer_kit.sample.logit_mask import MaskMemo
from deepinfer_kit.errors import InvariantError
from deepinfer_kit.step import StepResult
from deepinfer_kit.cache.hybrid_kv import HybridKVCache
from deepinfer_kit.engine.runner.layer_gate import gate_store

if TYPE_CHECKING:
    from deepinfer_kit.models.protocols import CausalLM, PagedKVStore
    from deepinfer_kit.engine.runner.static_decode import StagedDecode, StaticDecode
    from deepinfer_kit.engine.runner.token_slots import TokenSlots
    from deepinfer_kit.models.records import ForwardBatch
    from deepinfer_kit.sample.protocols import Sampler
    from deepinfer_kit.sched.records import SchedulePlan
    from deepinfer_kit.spec.protocols import DraftVerifier
    from deepinfer_kit.cache.hybrid_kv import KVStorage
    from deepinfer_kit.cache.tiers.protocols import KVConnectorWorker
    from deepinfer_kit.engine.runner.balance import ExpertBalancer
    from deepinfer_kit.engine.protocols import StepRunner

__all__ = ["LaunchedStep", "PreparedStep", "ModelRunner"]  # PreparedStep re-exported from engine.prepared


class ModelRunner:
    """Host -> device: lays out a plan's chunks as one flattened batch, then executes it.

    Args:
        model: the model (any :class:`CausalLM`).
        kv_cache: the paged KV storage the model reads and writes.
        sampler: draws tokens from the logits.
        device: the model's device.
        generator: random source of unseeded requests (on ``device``).
        static_decode: run decode rounds (one token per request, at most the top of its
            ladder) on these static buffers / captured graphs; ``None``: every round
            eagerly on freshly copied inputs. Rounds that verify drafts (more tokens
            than chunks) always run eagerly.
        verifier: checks the drafts of chunks with ``spec_token_ids``; ``None`` when the
            engine does not speculate (such a chunk is then an error).
        balancer: live EPLB; after every forward it records the routed counts into its
            window (on the device). Decode rounds still take the static path: MoE layers
            leave padded rows out of their counts, and a rebalance rewrites the slot maps
            and the selector tables in place (fixed shapes), so captured graphs stay valid.
        token_slots: the device slots that carry each sequence's newest sampled token to
            the next step (needed by an overlapped engine, whose plans have
            placeholders); ``None``: a plan with a placeholder is an error, and no step
            writes slots (the synchronous engine pays nothing).
        draft_probs: ``draft_probs(sequence id, drafts)`` -> the ``[len(drafts), V]``
            distributions the drafts were drawn from, or ``None`` (one-hot drafts): what
            the verifier reads for a chunk's drafts (the speculation's
            :meth:`~deepinfer_kit.spec.speculation.Speculation.draft_probs`). Speculation
            itself wraps this runner (:class:`~deepinfer_kit.engine.runner.speculative.SpeculativeRunner`).
        grammar: masks the rows under a structured-output grammar before anything reads
            their logits (:class:`~deepinfer_kit.engine.runner.grammar_stage.GrammarStage`);
            ``None`` refuses such rows (``InvariantError``).

    Every part is given here, once: nothing is attached to a runner after it is built
    (:func:`~deepinfer_kit.engine.runner.build.build_device` warms a bare runner up, then
    builds the serving one over the same parts).
    """

    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVStorage,
        sampler: Sampler,
        *,
        device: torch.device,
        generator: torch.Generator | None = None,
        static_decode: StaticDecode | None = None,
        verifier: DraftVerifier | None = None,
        balancer: ExpertBalancer | None = None,
        token_slots: TokenSlots | None = None,
        draft_probs: Callable[[str, Sequence[int]], torch.Tensor | None] | None = None,
        grammar: GrammarStage | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.device = device
        self.generator = generator
        self.block_size = kv_cache.block_size
        self._last: dict[str, int] = {}  # sequence id -> token the previous step sampled,
        # for sequences whose penalties / min_tokens read their history only
        self._launches = 0  # steps launched so far (LaunchedStep.ordinal)
        self._pin = device.type == "cuda"
        self._masks = MaskMemo()  # skips the logit-edit check of a round with last round's params
        self.static = static_decode
        self.verifier = verifier
        self.balancer = balancer
        self.token_slots = token_slots
        self.draft_probs = draft_probs
        self.grammar = grammar
        self.kv_transfer: KVConnectorWorker | None = None  # the KV tiers' device side (set by the builder)

    @property
    def num_blocks(self) -> int:
        """Blocks in the KV pool."""
        return self.kv_cache.num_blocks

    def close(self) -> None:
        """Stop the KV connector's device side (its copy thread), when it has one to
        stop; nothing else beyond memory (the :class:`StepRunner` contract)."""
        close = getattr(self.kv_transfer, "close", None)
        if close is not None:
            close()

    def check_idle(self) -> None:
        """Raise :class:`InvariantError` unless the runner holds no per-sequence state:
        every token slot free (called by the engine's idle check, with nothing in
        flight; a speculating wrapper checks its drafter too)."""
        if self.token_slots is not None:
            self.token_slots.check_all_free()  # its followers: a wrapper's drafting

    def prepare(self, plan: SchedulePlan, *, record_expert_counts: bool = False) -> PreparedStep:
        """Build the forward inputs and the sampling rows of ``plan``. ``record_expert_counts``:
        the step returns its MoE routing counts (traces).

        Reads only the plan's snapshots (token ids, block tables, sampling rows), never a
        live request, so it may run while the scheduler mutates its requests and while
        the previous step executes. A placeholder token (its value is being sampled by
        the step in flight) is laid out as a hole that :meth:`execute` gathers from the
        sequence's token slot on the device; every chunk that samples leases its
        sequence's slot for this step (:meth:`TokenSlots.lease`). The inputs and the
        slot indices go to the device in one copy of one host buffer (pinned on CUDA); a
        decode round that fits the static ladder is only staged on the host (copied into
        the static buffers by :meth:`execute`). O(T + R * max_blocks).

        A chunk with drafts gets ``1 + len(spec_token_ids)`` sampling rows (see
        :class:`VerifiedChunk`).

        Raises:
            InvariantError: a chunk with more than one placeholder, placeholders or a fork
                together with drafts, drafts without a verifier, a placeholder without
                token slots, or no token slot free.
        """
        return self._layout(plan, record_expert_counts)

    def _layout(self, plan: SchedulePlan, record_expert_counts: bool) -> PreparedStep:
        """:meth:`prepare`'s layout of a plan (see there): the host lists
        (:func:`lay_out`), then one copy to the device or a staging for the static buffers."""
        out = lay_out(plan, step_id=plan.step_id, slots=self.token_slots, can_verify=self.verifier is not None,
                      draft_probs=self.draft_probs)
        input_ids, positions, seq_lens, tables = out.input_ids, out.positions, out.seq_lens, out.tables
        num_tokens, prompt, logits_rows = out.num_tokens, out.prompt, out.logits_rows
        forward: ForwardBatch | None = None
        staged: StagedDecode | None = None
        slot_tail: torch.Tensor | None = None
        static = self.static
        tail = out.routes.tail()
        if (
            static is not None
            and not prompt.rows  # prompt-logprob rows are extra logits rows
            and num_tokens == plan.num_chunks > 0
            and static.size_for(num_tokens) is not None
        ):
            staged = static.stage(input_ids, positions, seq_lens, tables, tail)
        else:
            host, layout = pack_inputs(
                input_ids, positions, out.query_lens, seq_lens, tables, logits_rows + prompt.rows,
                block_size=self.block_size, pin_memory=self._pin, tail=tail,
            )  # fmt: skip
            device = host.to(self.device, non_blocking=True) if self._pin else host
            forward = unpack_inputs(device, layout)
            slot_tail = unpack_tail(device, layout)
            if out.shared_rows:
                forward.shared_rows = to_device(out.shared_rows, torch.int64, self.device)
        return PreparedStep(
            plan=plan, forward=forward, sampling=out.sampling(self.generator), row_counts=out.row_counts,
            logits_rows=logits_rows, staged=staged, routes=out.routes, slot_tail=slot_tail,
            placeholder_rows=out.hole_rows, grammar_rows=out.grammar_rows, verified=out.verified, prompt=prompt,
            record_expert_counts=record_expert_counts,
        )

    def execute(self, step: PreparedStep) -> StepResult:
        """Run ``step`` to the end: ``finish(launch(step))`` (see both); returns tokens
        per chunk. Mutates the KV cache and the token slots this step writes. Blocks until
        the tokens are on the host."""
        return self.finish(self.launch(step))

    def pipelines(self, step: PreparedStep) -> bool:
        """Whether ``step`` may be launched while the step before it is launched but not
        finished: not when rows of it read the in-flight token's value on the host
        (penalties, ``min_tokens``: :attr:`PreparedStep.placeholder_rows`, filled from
        the previous step's finish). Host only, O(1)."""
        return not step.placeholder_rows

    def launch(self, step: PreparedStep) -> LaunchedStep:
        """Queue ``step``'s device work and return without waiting for its tokens: fill
        the placeholders, copy-on-write block copies, the forward, the draw, the token
        slots' publish and the copy of the sampled rows to the host (pinned,
        non-blocking, an event after it on CUDA; see :func:`copy_back`).

        Steps launch in schedule order (one thread or stream): a placeholder of this step
        is gathered on the device from its sequence's token slot, which the step before
        wrote after sampling (no host sync between the two), so step ``k + 1`` may launch
        before step ``k`` finished when :meth:`pipelines` allows. One that the previous
        step did not sample (it failed, or its row was not finite: the slot holds ``-1``)
        is never fed as a token: its chunk is reported in ``errors``. Rows whose
        penalties or ``min_tokens`` read the in-flight token get it on the host, from the
        previous step's finish (so that step must have finished).

        ``logit_bias`` / allowed ids / bad words edit the rows' logits first
        (:func:`edit_logits`). A sampled row whose logits hold a NaN or an infinity is
        flagged on the device (its chunk gets no token); the flag rides on the copy back.
        With ``record_expert_counts`` given to :meth:`prepare`, the MoE layers' routing
        counts of the round (real rows only, on the static path too) are copied on the
        device and read at :meth:`finish` (for traces).

        Mutates the KV cache (the scheduled tokens' K/V), the token slots this step
        writes and the runner's launch count. Raises what the forward or the sampler
        raises (the step failed; its slots read ``-1``).
        """
        self._launches += 1
        ordinal = self._launches
        last, self._last = self._last, {}
        forward, tail = step.forward, step.slot_tail
        if step.staged is not None:
            assert self.static is not None
            forward, tail = self.static.load(step.staged)
        assert forward is not None
        slots, routes = self.token_slots, step.routes
        gathered = slots.resolve(routes, tail, forward.input_ids) if slots and tail is not None else None
        histories = step.sampling.output_token_ids
        for r, sid in step.placeholder_rows:
            if sid in last:
                histories[r] = (*histories[r], last[sid])
        store = self._prepare_pool(step.plan, eager=step.staged is None)
        with torch.inference_mode():
            logits = self._logits(step, forward, store)
            expert_counts, slot_counts = self._expert_counts(step.record_expert_counts)
            logits, prompt_maps = step.prompt.split(logits, len(step.logits_rows), len(step.row_counts))
            if not step.sampling.params:
                done = StepResult(token_ids=[[] for _ in step.row_counts], expert_counts=host_rows(expert_counts),
                                  slot_counts=host_rows(slot_counts))
                return LaunchedStep(ordinal=ordinal, step=step, done=done, prompt_maps=prompt_maps)
            finite, clean = finite_rows(logits)
            if step.grammar_rows:
                if self.grammar is None:
                    raise InvariantError("rows under a structured-output grammar, and no grammar stage")
                finite = finite & self.grammar.apply(clean, step.grammar_rows, step.sampling.params, histories)
            raw = self._masks.edit(clean, step.sampling, pin_memory=self._pin)
            emitted: list[int] = []
            if step.verified:
                assert self.verifier is not None  # prepare checked it
                sampled, emitted = verify_round(
                    self.sampler, self.verifier, clean, step.sampling, step.verified
                )
            else:
                sampled = self.sampler(clean, step.sampling)
            if raw is not clean:  # logprobs stay those of the raw logits, as vLLM's
                attach_logprobs(sampled, raw, step.sampling.max_logprobs)
            flagged = torch.where(finite, sampled.token_ids, UNSAMPLED)
            if gathered is not None and slots is not None and tail is not None:
                flagged = slots.publish(routes, tail, gathered, flagged)
            copy = copy_back(flagged, sampled, step.sampling.params)
        return LaunchedStep(ordinal=ordinal, step=step, copy=copy, emitted=emitted, expert_counts=expert_counts,
                            slot_counts=slot_counts, prompt_maps=prompt_maps)

    def _prepare_pool(self, plan: SchedulePlan, *, eager: bool) -> PagedKVStore:
        """Before the forward: the group tables' updates, the KV tiers' saves (blocks
        evicted this round are read before the forward overwrites them), the
        copy-on-write copies, then the tiers' loads into the blocks the forward reads.
        Returns the store the forward uses: the pool, or (an ``eager`` forward whose
        connector loads layer by layer) a gated view of it that waits for each layer's
        loads as the forward reaches it (:func:`gate_store`)."""
        if plan.table_updates:
            assert isinstance(self.kv_cache, HybridKVCache), "table updates for a cache without groups"
            self.kv_cache.apply_table_updates(plan.table_updates)
        transfers, connector = plan.kv_transfers, self.kv_transfer
        if transfers is not None:
            assert connector is not None, "KV transfers for a runner without a KV connector"
            connector.start_save_kv(transfers)
        if plan.block_copies:
            self.kv_cache.copy_blocks(plan.block_copies)
        if transfers is None or connector is None:
            return self.kv_cache
        connector.start_load_kv(transfers)
        layered = getattr(connector, "wait_for_layer_load", None)
        if layered is None or not eager or not transfers.loads:
            connector.wait_for_load()
            return self.kv_cache
        return gate_store(self.kv_cache, layered)

    def finish(self, launched: LaunchedStep) -> StepResult:
        """Wait for ``launched``'s copy back (its event on CUDA) and build its result:
        tokens per chunk (a chunk whose row was not finite, or that continued from a
        token never sampled, gets none and an ``errors`` entry), logprob maps, drafts
        accepted. Finish steps in launch order, each once.

        Mutates the runner's host copy of the step's history tokens (read by the next
        launch's placeholder rows), unless a later step was launched already (that one's
        finish provides them). Blocks until the tokens are on the host.
        """
        if launched.done is not None:
            if launched.prompt_maps is not None:  # a round of prompt-logprob rows that draws nothing
                launched.done.prompt_logprobs = launched.prompt_maps.build()
                launched.prompt_maps = None
            return self._with_kv_report(launched.done, launched.step.plan if launched.step is not None else None)
        step, copy = launched.step, launched.copy
        assert step is not None and copy is not None
        tokens, logprobs_host = copy.read()
        logprobs = logprob_maps(tokens, logprobs_host, step.row_counts, step.sampling) if logprobs_host is not None else None
        kept = dict(zip((v.chunk for v in step.verified), launched.emitted))
        token_ids, errors, last = chunk_results(step.plan, tokens, step.row_counts, kept,
                                                step.sampling.positions, logprobs)
        if launched.ordinal == self._launches:  # no later launch has begun: the next one reads these
            self._last = last
        drafted = [0] * len(step.plan.decodes) + [len(c.spec_token_ids) for c in step.plan.chunks] if step.verified else []
        return self._with_kv_report(StepResult(
            token_ids=token_ids,
            logprobs=logprobs,
            num_drafted=drafted,
            num_accepted=[max(len(t) - 1, 0) if d else 0 for t, d in zip(token_ids, drafted)],
            errors=errors if errors.count(None) != len(errors) else [],
            expert_counts=host_rows(launched.expert_counts),
            slot_counts=host_rows(launched.slot_counts),
            prompt_logprobs=launched.prompt_maps.build() if launched.prompt_maps is not None else None,
        ), step.plan)

    def _with_kv_report(self, result: StepResult, plan: SchedulePlan | None = None) -> StepResult:
        """``result`` with the KV connector's report of the transfers finished since the
        last one; a chunk whose blocks a failed load wrote ends with an error (its forward
        read garbage)."""
        if self.kv_transfer is None:
            return result
        report = self.kv_transfer.get_finished()
        result.kv_transfers = report
        if report is not None and report.failed_loads and plan is not None:
            failed = set(report.failed_loads)
            chunks = plan.all_chunks()
            errors = result.errors or [None] * len(chunks)
            for i, chunk in enumerate(chunks):
                if errors[i] is None and failed.intersection(chunk.block_table):
                    errors[i] = "KV load failed: a block of this sequence could not be read from its tier"
            result.errors = errors
        return result

    def _expert_counts(self, record: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Feed the balancer's window; when tracing, the round's ``[L, E]`` per-expert and
        ``[L, P]`` per-slot counts as new device tensors (read on the host by
        :meth:`finish`, so a traced round launches without a sync)."""
        if self.balancer is not None:
            self.balancer.record(self.model)
        if not record:
            return None, None
        slots = self.balancer.slot_counts() if self.balancer is not None else None
        return self.model.expert_counts(), slots

    def _logits(self, step: PreparedStep, forward: ForwardBatch, store: PagedKVStore) -> torch.Tensor:
        """``[rows, V]`` float32 logits of the sampling rows: an eager forward over
        ``store``, or the static path's padded ``[size, V]`` with the padded rows dropped.
        A forward over a gated store (:func:`gate_store`) is followed by the connector's
        ``wait_for_load`` (every layer's loads done, even on an error), so nothing after
        it sees a load in flight."""
        if step.staged is None:
            if store is self.kv_cache:
                return self.model(forward, store)
            assert self.kv_transfer is not None
            try:
                return self.model(forward, store)
            finally:
                self.kv_transfer.wait_for_load()
        assert self.static is not None
        full = self.static.forward(forward, step.staged.size)
        rows = step.logits_rows
        if rows == list(range(len(rows))):
            return full[: len(rows)]
        return full.index_select(0, to_device(rows, torch.int64, full.device))


if TYPE_CHECKING:
    _check: type[StepRunner] = ModelRunner
