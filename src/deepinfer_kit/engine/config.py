"""EngineConfig: everything needed to build the default components of an Engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from deepinfer_kit._dtypes import DTYPE_ALIASES, DTYPE_NAMES
from deepinfer_kit._validators import int_at_least, one_of
from deepinfer_kit.cache.layer_groups import KVLayout
from deepinfer_kit.cache.tiers.config import TierConfig
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.spec.records import SpecConfig

if TYPE_CHECKING:
    from collections.abc import Sequence

    from deepinfer_kit.eplb.config import EplbConfig

__all__ = ["DEFAULT_KV_CACHE_MEMORY_MB", "EngineConfig"]

DEFAULT_KV_CACHE_MEMORY_MB = 512  # the CPU pool's budget when kv_cache_memory_mb is None

_IMPLS = ("auto", "ref", "triton")
_DEVICE_TYPES = ("cpu", "cuda")


def _check_device(instance: object, attribute: attrs.Attribute[str], value: object) -> None:
    """A torch device string of type cpu or cuda, ``"<type>"`` or ``"<type>:<index>"``
    as ``torch.device`` parses it (read without importing torch, so that configs of the
    simulator stay light; whether CUDA is present is checked when the engine is built)."""
    kind, sep, index = value.partition(":") if isinstance(value, str) else ("", "", "")
    if kind not in _DEVICE_TYPES or (sep and not (index.isascii() and index.isdigit())):
        raise ConfigError(
            f"{attribute.name} must be 'cpu', 'cuda' or 'cuda:<index>', got {value!r}"
        )


def _check_optional_bool(instance: object, attribute: attrs.Attribute[bool | None], value: object) -> None:
    """``None``, ``True`` or ``False`` (a ConfigError naming the field otherwise)."""
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"{attribute.name} must be True, False or None, got {value!r}")


def _check_fraction(instance: object, attribute: attrs.Attribute[float], value: object) -> None:
    """A number in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(f"{attribute.name} must be a number in (0, 1], got {value!r}")


def _check_seconds(instance: object, attribute: attrs.Attribute[float], value: object) -> None:
    """A positive, finite number of seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ConfigError(f"{attribute.name} must be a positive number of seconds, got {value!r}")


def _coerce_spec(value: Any) -> SpecConfig | None:
    """``speculative`` from a SpecConfig, a dict with its keys, or None."""
    return SpecConfig.coerce(value)


def _coerce_tiers(value: Any) -> TierConfig | None:
    """``kv_tiers`` from a TierConfig, a dict with its keys, or None."""
    return TierConfig.coerce(value)


def _coerce_eplb(value: Any) -> EplbConfig | None:
    """``eplb`` from an EplbConfig, a dict with its keys, or None (the eplb package, which
    needs torch, is imported only when EPLB is asked for: the simulator imports this
    module without torch)."""
    if value is None:
        return None
    from deepinfer_kit.eplb.config import EplbConfig

    return EplbConfig.coerce(value)


@attrs.frozen(slots=True)
class EngineConfig:
    """How to build an :class:`~deepinfer_kit.engine.engine.Engine` from defaults.

    Attributes:
        model: a Hugging Face checkpoint folder, or an embedded model: ``"tiny"`` (seeded
            random weights, the default, which tests rely on) or ``"tiny-words"`` (trained on
            the project's docs; writes English-looking words).
        dtype: weights and KV dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"``;
            ``"auto"`` (the default, as ``LLM`` and the command line) reads the
            checkpoint's ``torch_dtype``: on CUDA a float32 checkpoint runs in bfloat16 (as
            vLLM's ``auto``), on CPU in its own dtype; the embedded models run in float32
            everywhere (:func:`~deepinfer_kit._dtypes.auto_dtype`). ``"half"``, ``"float"``,
            ``"bf16"`` are vLLM's aliases.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, … (a torch device string of type cpu
            or cuda; anything else, ``"meta"`` included, is a ConfigError).
        seed: seeds the embedded model's weights and the generator of unseeded requests.
        block_size: tokens per KV block (``P``).
        num_blocks: KV blocks in the pool; ``None`` sizes it from ``kv_cache_memory_mb``.
        kv_cache_memory_mb: KV memory budget (MiB) when ``num_blocks`` is ``None``; ``None``
            takes :data:`DEFAULT_KV_CACHE_MEMORY_MB` on CPU and the budget of
            ``gpu_memory_utilization`` on CUDA. Given on CUDA it is the pool's size (as
            vLLM's ``kv_cache_memory_bytes``), refused when it exceeds that budget.
        gpu_memory_utilization: on CUDA when ``num_blocks`` is ``None``, the fraction of
            the device's memory this engine may use; the KV pool takes that minus what is
            in use once the weights are loaded (vLLM's rule).
        tokenizer: a folder whose ``tokenizer.json`` (and chat template) replaces the
            checkpoint's; ``None`` uses the checkpoint's.
        max_model_len: prompt + output tokens of one request at most; ``None`` takes the
            model's maximum, capped (with a warning naming both) to what the KV pool holds.
        max_num_seqs: requests in one round at most.
        max_num_batched_tokens: token budget of one round.
        long_prefill_token_threshold: cap on one prefill chunk (0: no cap).
        enable_prefix_caching: reuse cached prompt blocks across requests.
        hybrid_kv_cache: a model with sliding-window layers keeps, in those layers, only
            each sequence's window (plus room for a speculative rollback) in pools of their
            own (``cache.hybrid_manager``, docs/hybrid_kv_cache.md); ``False``: every layer
            keeps every token, as a full-attention layer does.
        bounded_replay: under :attr:`hybrid_kv_cache`, a prefix hit whose sliding windows
            were evicted is served whole by recomputing only its last
            ``KVLayout.replay_bound`` tokens for the sliding layers (when that fits a
            round, :meth:`replay_limit`); ``False``: such a hit is shortened to one whose
            windows are cached.
        prefix_index: ``"radix"`` (radix tree, the default) or ``"hash"`` (hash chain);
            both give the same hits and evictions (exact LRU), the radix tree faster.
        scheduler: ``"continuous"`` or ``"static"`` batching.
        scheduler_policy: ``"fcfs"`` or ``"priority"``.
        attention_impl, sampler_impl, moe_impl: ``"auto"``, ``"ref"`` or ``"triton"``
            (``sampler_impl`` also picks the verifier's ops under ``speculative``).
        overlap: schedule round ``k + 1`` on the host while round ``k`` runs (on a CUDA
            stream, a worker thread, or the worker process of ``worker="process"``),
            committing tokens one step late; outputs are token for token those of the
            synchronous engine. ``None`` (the default) means on where it is both correct and
            measured faster (:attr:`overlapped`): on a CUDA device without ``speculative``
            (drafts need each round's tokens before the next is planned), and with
            ``worker="process"``; off for the in-process CPU engine, whose worker thread
            shares the GIL with the host and was measured slower (docs/overlap.md).
            ``True`` with ``speculative`` drafts on the runner's side as each round
            executes (docs/speculative.md); ``False`` forces the synchronous engine.
        max_logprobs: the most ``logprobs`` (and ``prompt_logprobs``) a request may ask
            for; requests asking for more are rejected with ConfigError at
            ``add_request``, as vLLM does. ``-1``: no cap (vLLM's meaning); a request's
            ``-1`` (the whole vocabulary) counts as the vocabulary size.
        cuda_graphs: on a CUDA device, capture the forward of decode rounds as CUDA graphs
            (one per size of the batch ladder, at build time, after warming every kernel
            up); no effect on CPU. ``False`` runs every round eagerly (the reference).
        static_decode: run decode rounds on static device buffers padded to the batch
            ladder (what graphs replay); ``None`` means exactly when graphs are captured.
            ``True`` on CPU runs the same padded path eagerly (tests pin it to the
            unpadded one); ``False`` turns graphs off too.
        worker: where the model runs: ``"inline"`` (the engine's process, the default) or
            ``"process"`` (a worker process of its own, :class:`~deepinfer_kit.engine.
            process_runner.ProcessRunner`: the host's scheduling and the forward then hold
            separate interpreter locks, which is what lets overlap pay on CPU); with
            ``speculative`` the worker drafts too, with ``eplb`` it keeps the load window
            and moves the expert weights (the host's ``engine.balancer`` is a handle).
            ``"launched"``: this process is one rank of ``tensor_parallel *
            expert_parallel`` started by a launcher (``torchrun``, on one host or several:
            ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``); every rank runs
            the whole engine on the same inputs, its model being its shard (docs/distributed.md).
        tensor_parallel: ranks attention, dense MLPs, the embedding and the LM head are
            sharded over (vLLM's ``tensor_parallel_size``; ``models.parallel``); inside each
            expert-parallel group, so the world is ``tensor_parallel * expert_parallel``
            ranks. More than 1 needs ``worker="process"`` (one worker process per rank, on
            this host) or ``"launched"``, and a CPU device (gloo) for now.
        collective_timeout: seconds any one collective of a multi-rank model may take; a
            rank that dies, raises or stalls surfaces as EngineDeadError within it.
        expert_parallel: ranks the MoE layers' experts are split over (each rank a worker
            process holding ``E / expert_parallel`` experts per layer, token copies sent to
            their expert's rank by all-to-all over gloo; attention runs on every rank).
            ``1``: no expert parallelism. More needs ``worker="process"`` and a CPU
            device; the expert slots must divide by it; with ``eplb`` the ranks are its
            GPUs (``eplb.num_gpus == expert_parallel``) and rebalances move expert weights
            rank to rank.
        kv_tiers: KV tiers under the device pool (a
            :class:`~deepinfer_kit.cache.tiers.TierConfig` or a dict with its keys, e.g.
            ``{"host_blocks": 4096, "disk_blocks": 65536, "disk_path": "/var/kv"}``): a
            prefix evicted from the device is loaded back instead of recomputed
            (docs/kv_tiers.md). Needs prefix caching and no sliding-window group
            (ConfigError otherwise). With ``worker="process"`` each rank's worker holds its
            heads' host slab in shared memory, which the scheduler side maps; with
            ``"launched"`` each rank's tiers hold its heads and agree with the other ranks.
            ``None``: the device pool only.
        speculative: speculative decoding (a :class:`~deepinfer_kit.spec.SpecConfig` or a
            dict with its keys, e.g. ``{"drafter": "ngram", "num_draft": 4}``); ``None``
            decodes one token per round.
        eplb: live expert load balancing (an :class:`~deepinfer_kit.eplb.EplbConfig` or a
            dict with its keys, e.g. ``{"window": 32, "interval": 32, "num_redundant": 8,
            "num_gpus": 4}``); ``None``: each expert in its own slot, no rebalancing. A
            model without MoE layers is a ConfigError at build. Decode rounds keep the
            static buffers and CUDA graphs: padded rows are not counted into the windows,
            and a rebalance rewrites the slot maps and selector tables in place.
        batch_invariant: every logit of a sequence — and so every token of a greedy or
            seeded request — bitwise the same whatever else runs in the batch, however its
            prompt is chunked, whether its prefix came from the cache, whether it is
            speculated (a verify row equals a decode row; seeded sampled drafts are verified
            by matching the plain sampler's own draw), overlapped, in a worker process or
            replayed from a padded CUDA graph, and whichever scheduler, cache index or
            drafter is plugged in (docs/batch_invariance.md). The model's matmuls are padded
            to fixed shapes and its attention reads keys in fixed chunks
            (``models.invariant``); costs throughput. ``tensor_parallel > 1`` is refused (a
            row's sums would be split over ranks).
        strict_components: fail fast, for developing a component: the first step whose
            layout, execution or commit raises stops the engine, re-raising that exception
            with its traceback (later calls raise :class:`EngineDeadError`), instead of
            ending the step's requests with ``error`` and serving on.
    """

    model: str = "tiny"
    dtype: str = attrs.field(default="auto", validator=one_of((*DTYPE_NAMES, "auto", *DTYPE_ALIASES)))
    device: str = attrs.field(default="cpu", validator=_check_device)
    seed: int = attrs.field(default=0, validator=int_at_least(0))
    block_size: int = attrs.field(default=16, validator=int_at_least(1))
    num_blocks: int | None = attrs.field(default=None, validator=attrs.validators.optional(int_at_least(1)))
    kv_cache_memory_mb: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(int_at_least(1)))
    gpu_memory_utilization: float = attrs.field(default=0.9, validator=_check_fraction)
    tokenizer: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(str))
    )
    max_model_len: int | None = attrs.field(default=None, validator=attrs.validators.optional(int_at_least(1)))
    max_num_seqs: int = attrs.field(default=128, validator=int_at_least(1))
    max_num_batched_tokens: int = attrs.field(default=2048, validator=int_at_least(1))
    long_prefill_token_threshold: int = attrs.field(default=0, validator=int_at_least(0))
    enable_prefix_caching: bool = True
    hybrid_kv_cache: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    bounded_replay: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    prefix_index: str = attrs.field(default="radix", validator=one_of(("hash", "radix")))
    scheduler: str = attrs.field(default="continuous", validator=one_of(("continuous", "static")))
    scheduler_policy: str = attrs.field(default="fcfs", validator=one_of(("fcfs", "priority")))
    attention_impl: str = attrs.field(default="auto", validator=one_of(_IMPLS))
    sampler_impl: str = attrs.field(default="auto", validator=one_of(_IMPLS))
    moe_impl: str = attrs.field(default="auto", validator=one_of(_IMPLS))
    max_logprobs: int = attrs.field(default=20, validator=int_at_least(-1))
    overlap: bool | None = attrs.field(default=None, validator=_check_optional_bool)
    cuda_graphs: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    static_decode: bool | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(bool))
    )

    worker: str = attrs.field(default="inline", validator=one_of(("inline", "process", "launched")))
    expert_parallel: int = attrs.field(default=1, validator=int_at_least(1))
    tensor_parallel: int = attrs.field(default=1, validator=int_at_least(1))
    collective_timeout: float = attrs.field(default=300.0, validator=_check_seconds)

    speculative: SpecConfig | None = attrs.field(default=None, converter=_coerce_spec)
    kv_tiers: TierConfig | None = attrs.field(default=None, converter=_coerce_tiers)
    eplb: EplbConfig | None = attrs.field(default=None, converter=_coerce_eplb)
    strict_components: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    batch_invariant: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    def __attrs_post_init__(self) -> None:
        self._check_parallel()
        if self.batch_invariant and self.tensor_parallel > 1:
            raise ConfigError(
                f"batch_invariant=True with tensor_parallel={self.tensor_parallel}: a row-parallel "
                f"layer sums each row's partial products over the ranks, so the logits would "
                f"depend on the parallel layout; use tensor_parallel=1")
        if self.expert_parallel > 1:
            if self.eplb is not None and self.eplb.num_gpus != self.expert_parallel:
                raise ConfigError(
                    f"with expert_parallel={self.expert_parallel} the ranks are eplb's GPUs: "
                    f"eplb.num_gpus must be {self.expert_parallel}, got {self.eplb.num_gpus}"
                )
        if self.kv_tiers is not None:
            self.check_kv_transfer()
        if not self.model:
            raise ConfigError(
                f"model must be a checkpoint path, 'tiny' or 'tiny-words', got {self.model!r}"
            )

    def check_kv_transfer(self) -> None:
        """Refuse what KV tiers or an injected KV connector cannot run with in this build
        (docs/kv_tiers.md says what each would need). Called at construction when
        ``kv_tiers`` is set, and at build for ``components.kv_connector``.

        Raises:
            ConfigError: prefix caching off.
        """
        if not self.enable_prefix_caching:
            raise ConfigError("kv_tiers needs enable_prefix_caching=True: the tiers hold published blocks")

    def kv_layout(self, windows: Sequence[int | None]) -> KVLayout | None:
        """The cache groups of a model whose layers have these sliding ``windows``
        (``ModelConfig.sliding_windows``; ``None``: full attention) under this config: a
        layout with sliding-window groups when :attr:`hybrid_kv_cache` and some layer slides (rollback room: the
        drafts of a round plus one, and one token for the round in flight when the next
        is planned), else ``None`` (one pool, every layer keeps every token). Read alike by
        the device side (the pools) and the host side (the manager)."""
        if not self.hybrid_kv_cache or not any(w is not None for w in windows):
            return None
        backtrack = 1 + (self.speculative.num_draft + 1 if self.speculative is not None else 0)
        return KVLayout.from_windows(windows, backtrack)

    def replay_limit(self) -> int:
        """The longest bounded replay the hybrid cache may serve a prefix hit with
        (``HybridKVCacheManager(replay_limit=)``): one chunk holds the replay and a token
        more beside every other running sequence's decode, under the long-prefill
        threshold; 0 when :attr:`hybrid_kv_cache` or :attr:`bounded_replay` is off."""
        if not self.hybrid_kv_cache or not self.bounded_replay:
            return 0
        room = self.max_num_batched_tokens - self.max_num_seqs
        if self.long_prefill_token_threshold:
            room = min(room, self.long_prefill_token_threshold)
        return max(0, room - 1)

    def sliding_pool_sizes(self, layout: KVLayout) -> list[int]:
        """Blocks of each sliding group's pool for this config's round shape."""
        return layout.sliding_pool_blocks(self.block_size, self.max_num_seqs, self.max_num_batched_tokens)

    def full_group_share(self, layout: KVLayout, budget: int | None, layer_token_bytes: int,
                         longest: int) -> tuple[int | None, int | None]:
        """What a hybrid pool's full group gets, as ``(num_blocks, budget)`` for the usual
        sizing (one of them set, or both ``None`` without a budget): :attr:`num_blocks` when
        given; for a full group without layers, block ids that are only names (``max_num_seqs``
        sequences of ``longest`` tokens, twice over for the prefix cache); else the bytes of
        ``budget`` the sliding groups' pools (:meth:`sliding_pool_sizes`, at
        ``layer_token_bytes`` per token and layer) leave. Read alike by the engine's pools and
        the simulator's.

        Raises:
            ConfigError: the budget does not hold the sliding groups' pools.
        """
        P = self.block_size
        if self.num_blocks is not None:
            return self.num_blocks, None
        if not layout.layers_of(0):
            return 2 * self.max_num_seqs * -(-longest // P) + 1, None
        if budget is None:
            return None, None
        sizes = self.sliding_pool_sizes(layout)
        sliding = sum(n * len(layout.layers_of(g)) for (g, _), n in zip(layout.sliding(), sizes)) * P * layer_token_bytes
        if budget <= sliding:
            raise ConfigError(
                f"the KV budget of {budget} bytes does not hold the sliding-window layers' pools ({sliding} bytes "
                f"for {sizes} blocks of {P} tokens: the windows of max_num_seqs={self.max_num_seqs} sequences, "
                f"running and idle); give the KV cache more memory or lower max_num_seqs")
        return None, budget - sliding

    def _check_parallel(self) -> None:
        """Multi-rank models: a worker kind that runs one process per rank, CPU ranks."""
        for name in ("tensor_parallel", "expert_parallel"):
            value = getattr(self, name)
            if value > 1 and self.worker == "inline":
                raise ConfigError(
                    f"{name}={value} runs one process per rank: set worker='process' (spawned "
                    f"here) or worker='launched' (started by torchrun), got worker='inline'")
            if value > 1 and not self.device.startswith("cpu"):
                raise ConfigError(f"{name}={value} runs on CPU ranks over gloo for now; "
                                  f"got device={self.device!r}")

    @property
    def overlapped(self) -> bool:
        """Whether the engine built from this config overlaps: ``overlap`` when set, else
        True on a CUDA device unless ``speculative`` is set, and True with a worker process
        (on CPU in one process the worker thread and the host take turns on the GIL:
        measured slower, see docs/overlap.md)."""
        if self.overlap is not None:
            return self.overlap
        if self.worker == "process":
            return True
        return self.speculative is None and self.device.startswith("cuda")
