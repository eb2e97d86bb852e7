"""StaticDecode: decode rounds on static device buffers, padded to a ladder of batch
sizes, and on CUDA replayed as captured CUDA graphs.

A decode round (every request computes one token) is padded to the next size of the
ladder ``1, 2, 4, 8, 16, 24, …, max_num_seqs``. Its inputs are copied into device buffers
that never move, so the forward of each size can be captured once as a CUDA graph (one
launch instead of hundreds) and replayed with new contents. A padded row is a request
of one token at position 0 with context 1, block table of block 0 (read, never
written) and slot :attr:`PagedKVCache.pad_slot` (its K/V write goes to the scratch block);
its logits row is dropped, and the batch marks it (``ForwardBatch.real_rows``, computed on the
device from the slots) so that MoE layers leave its routed copies out of their expert
counts: a traced round's counts are those of the real rows, captured or not. Prefill and
mixed rounds run eagerly elsewhere. On CPU the
same buffers run eagerly, so CPU tests pin this path to the unpadded one token for token.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import attrs
import torch

from deepinfer_kit.cache.hybrid_kv import KVStorage
from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.models.packing import aligned_len, append_tables, int64_host
from deepinfer_kit.errors import ConfigError, GraphCaptureError
from deepinfer_kit.models.attention.layout import step_slots
from deepinfer_kit.models.attention.splits import decode_context_buckets, split_target
from deepinfer_kit.models.protocols import CausalLM
from deepinfer_kit.models.records import AttentionMetadata, ForwardBatch

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

__all__ = ["StaticDecode", "StagedDecode", "batch_ladder", "device_buckets"]


def batch_ladder(max_num_seqs: int) -> list[int]:
    """The padded batch sizes: ``1, 2, 4, 8``, then multiples of 8, up to and including
    ``max_num_seqs`` (as vLLM's capture sizes)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += range(8, max_num_seqs, 8)
    return [*sizes, max_num_seqs]


def device_buckets(kv_cache: KVStorage, max_num_seqs: int, max_model_len: int) -> dict[int, list[int]]:
    """The context buckets of an engine's decode graphs (:class:`StaticDecode`'s
    ``context_buckets``): :func:`~deepinfer_kit.models.attention.splits.decode_context_buckets`
    of its ladder, asked with the pool's KV heads (this rank's) and the split target of its
    device (one bound per size off CUDA, where the attention never splits)."""
    return decode_context_buckets(batch_ladder(max_num_seqs), max_model_len, kv_cache.num_kv_heads,
                                  split_target(kv_cache.device))


@attrs.define(slots=True, eq=False)
class StagedDecode:
    """One decode round laid out on the host for a ladder size.

    Attributes:
        host: ``[4 * size + size * width + tail]`` int64 (pinned on CUDA): ids,
            positions, slots and context lengths of ``size`` rows, their block tables,
            then the caller's ``tail`` (the token-slot indices of an overlapped round).
        size: the ladder size the round is padded to.
        num_requests: the real rows (the first ones).
        width: block-table columns staged (the widest real table).
        seq_lens: ``[size]`` host context lengths (1 for a padded row).
    """

    host: torch.Tensor
    size: int
    num_requests: int
    width: int
    seq_lens: list[int]


class StaticDecode:
    """Static buffers and captured graphs of decode rounds for one model and KV pool.

    Args:
        model: the model; its forward must not synchronise with the host to be captured.
        kv_cache: the pool it reads and writes (its tensors never move).
        max_num_seqs: the largest round (the top of the ladder).
        max_model_len: the longest context (sets the block-table width).
        context_buckets: per ladder size, ascending context bounds ending at
            ``max_model_len``; one graph is captured per (size, bound), with the bound as
            its host context length, and a round replays the graph of the first bound
            at or above its longest context (what sizes the attention's split count:
            :func:`~deepinfer_kit.models.attention.splits.decode_context_buckets`). ``None``:
            one bound per size, ``max_model_len``.

    Buffers: ``4 * max_num_seqs`` int64 plus ``max_num_seqs * ceil(max_model_len / P)``
    int64 on the pool's device, allocated once, each row 16-byte aligned (Triton
    specialises kernels on pointer alignment, so every ladder size sees aligned inputs);
    once captured, one ``[max_num_seqs, V]`` logits buffer that every graph writes.
    """

    def __init__(
        self, model: CausalLM, kv_cache: KVStorage, *, max_num_seqs: int, max_model_len: int,
        context_buckets: Mapping[int, Sequence[int]] | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = batch_ladder(max_num_seqs)
        self.max_model_len = max_model_len
        top, dev = self.sizes[-1], kv_cache.device
        self.width = -(-max_model_len // kv_cache.block_size)
        self._flat = torch.zeros(4, aligned_len(top), dtype=torch.int64, device=dev)
        self._tables = torch.zeros(top, self.width, dtype=torch.int64, device=dev)
        self._starts = torch.arange(top + 1, dtype=torch.int64, device=dev)
        self._real = torch.zeros(aligned_len(top), dtype=torch.bool, device=dev)  # slot != pad_slot
        self._pin = dev.type == "cuda"
        self.buckets = {size: [max_model_len] for size in self.sizes}
        for size, bounds in (context_buckets or {}).items():
            if size not in self.buckets or list(bounds) != sorted(bounds) or bounds[-1] != max_model_len:
                raise ConfigError(
                    f"context_buckets[{size}] must be ascending bounds ending at max_model_len "
                    f"({max_model_len}) for a ladder size of {self.sizes}, got {list(bounds)}"
                )
            self.buckets[size] = list(bounds)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._logits: torch.Tensor | None = None  # [top, V], the captured graphs' output

    @property
    def captured_sizes(self) -> list[int]:
        """The ladder sizes with at least one captured graph (empty off CUDA)."""
        return sorted({size for size, _ in self._graphs})

    @property
    def captured_graphs(self) -> list[tuple[int, int]]:
        """``(size, context bound)`` of every captured graph (empty off CUDA)."""
        return sorted(self._graphs)

    def graph_key(self, size: int, max_seq_len: int) -> tuple[int, int]:
        """``(size, bound)``: the graph a round of ladder size ``size`` whose longest
        context is ``max_seq_len`` replays (the first bound at or above it)."""
        bounds = self.buckets[size]
        return size, bounds[min(bisect.bisect_left(bounds, max_seq_len), len(bounds) - 1)]

    def size_for(self, num_requests: int) -> int | None:
        """The ladder size a round of ``num_requests`` pads to; ``None`` when too large."""
        for size in self.sizes:
            if size >= num_requests:
                return size
        return None

    def stage(
        self,
        input_ids: Sequence[int],
        positions: Sequence[int],
        seq_lens: Sequence[int],
        tables: Sequence[Sequence[int]],
        tail: Sequence[int] = (),
    ) -> StagedDecode:
        """Lay out a decode round (one token per request) padded to its ladder size,
        with ``tail`` appended (it travels in the same copy; :meth:`load` returns it).

        Host only (reads the lists, no device work), so it may run while another round
        executes.

        Raises:
            ValueError: more requests than the top of the ladder.
            ConfigError: a table too short for its context.
        """
        n = len(input_ids)
        size = self.size_for(n)
        if size is None:
            raise ValueError(f"a decode round of {n} requests exceeds the ladder {self.sizes}")
        pad = size - n
        width = max((len(t) for t in tables), default=1)
        slots = step_slots([1] * n, seq_lens, tables, self.kv_cache.block_size)
        padded_lens = [*seq_lens, *([1] * pad)]
        values = [*input_ids, *([0] * pad), *positions, *([0] * pad)]
        values += slots
        values += [self.kv_cache.pad_slot] * pad
        values += padded_lens
        append_tables(values, tables, width)
        values += [0] * (width * pad)
        values += tail
        host = int64_host(values, pin_memory=self._pin)
        return StagedDecode(host=host, size=size, num_requests=n, width=width, seq_lens=padded_lens)

    def load(self, staged: StagedDecode) -> tuple[ForwardBatch, torch.Tensor]:
        """Copy ``staged`` to the device (one copy of its host buffer, asynchronous on
        CUDA) and from there into the static buffers; returns the forward inputs as views
        of those buffers, and the staged tail (``[tail]`` int64, on the device).

        Called on the executing thread, in stream order after the previous round's
        forward (which read the same buffers). Block-table columns beyond ``width`` keep
        old block ids, never read (a row reads only the blocks of its context).
        """
        b, w = staged.size, staged.width
        device = staged.host.to(self._flat.device, non_blocking=True)
        self._flat[:, :b].copy_(device[: 4 * b].view(4, b))
        torch.ne(self._flat[2, :b], self.kv_cache.pad_slot, out=self._real[:b])
        self._tables[:b, :w].copy_(device[4 * b : 4 * b + b * w].view(b, w))
        return self._batch(b, staged.seq_lens), device[4 * b + b * w :]

    def forward(self, batch: ForwardBatch, size: int) -> torch.Tensor:
        """The logits of a loaded round, ``[size, V]`` float32: rows of the logits buffer
        the captured graphs share (overwritten by the next replay; the graph of
        :meth:`graph_key`) or an eager forward."""
        graph = self._graphs.get(self.graph_key(size, batch.attn.max_seq_len))
        if graph is None or self._logits is None:
            return self.model(batch, self.kv_cache)
        graph.replay()
        return self._logits[:size]

    def capture(self) -> None:
        """Capture the forward of every ladder size and context bound as a CUDA graph
        (largest first, one shared memory pool), after two eager warm-up runs each, which
        also compile every kernel the decode round uses. CUDA only.

        Each graph copies its logits into rows ``[:size]`` of one shared ``[top, V]``
        buffer and keeps no output of its own, so the pool holds one set of logits, not
        one per size. Mutates the scratch block only (every warm-up row writes
        :attr:`PagedKVCache.pad_slot`). A failure leaves nothing captured and raises: an
        engine asked for graphs never falls back to eager rounds unseen
        (``cuda_graphs=False`` is the way to run eagerly).

        Raises:
            ConfigError: the device ran out of memory while capturing (the KV pool or
                the ladder is too large for what is left).
            GraphCaptureError: the forward of a size could not be captured (it
                synchronises with the host, or allocates outside the graph pool); the
                message names the batch size and the cause.
        """
        pool = None
        size = self.sizes[-1]
        try:
            for size in reversed(self.sizes):
                for bound in reversed(self.buckets[size]):
                    pool = self._capture_one(size, bound, pool)
        except torch.cuda.OutOfMemoryError as exc:
            self._graphs.clear()
            self._logits = None
            raise ConfigError(
                f"capturing the decode graphs (batch sizes up to {self.sizes[-1]}) ran out of "
                f"device memory; lower gpu_memory_utilization or max_num_seqs, or set "
                f"cuda_graphs=False"
            ) from exc
        except RuntimeError as exc:  # capture refuses host syncs and foreign streams
            self._graphs.clear()
            self._logits = None
            cause = str(exc).splitlines()[0] if str(exc) else repr(exc)
            raise GraphCaptureError(
                f"capturing the decode round of batch size {size} as a CUDA graph failed: "
                f"{cause}; build with cuda_graphs=False to run decode rounds eagerly"
            ) from exc
        torch.cuda.synchronize(self.kv_cache.device)

    def run_padded(self, size: int) -> torch.Tensor:
        """Eager forwards of ladder size ``size`` with every row a padded row, one per
        context bound (warm-up: it compiles what that size's rounds launch). Returns the
        last ``[size, V]`` logits; mutates only the scratch block."""
        with torch.inference_mode():
            for bound in self.buckets[size]:
                logits: torch.Tensor = self.model(self._padded_batch(size, bound), self.kv_cache)
        return logits

    def _capture_one(self, size: int, bound: int, pool: _POOL_HANDLE | None) -> _POOL_HANDLE:
        """Warm ``(size, bound)`` up twice on a side stream, then capture it into ``pool``;
        returns the pool (the first capture creates it). Allocates the shared logits
        buffer from the first (largest) size's warm-up output."""
        batch = self._padded_batch(size, bound)
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                warm = self.model(batch, self.kv_cache)
        torch.cuda.current_stream().wait_stream(side)
        if self._logits is None:
            self._logits = torch.empty(self.sizes[-1], warm.shape[1], dtype=warm.dtype,
                                       device=warm.device)
        del warm
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self._logits[:size].copy_(self.model(batch, self.kv_cache))
        self._graphs[(size, bound)] = graph
        return graph.pool()

    def _padded_batch(self, size: int, bound: int) -> ForwardBatch:
        """Size ``size``'s views with every row a padded row (what warm-up and capture
        run on); the host lengths say ``bound`` so that a kernel sizing its work from them
        (split-K) covers every context the graph of that bound will see."""
        batch = self._batch(size, [bound] * size)
        batch.input_ids.zero_()
        batch.positions.zero_()
        batch.attn.slot_mapping.fill_(self.kv_cache.pad_slot)
        batch.attn.seq_lens.fill_(1)
        batch.attn.block_tables.zero_()
        self._real[:size].fill_(False)
        return batch

    def _batch(self, size: int, seq_lens: list[int]) -> ForwardBatch:
        """Views of the static buffers for ladder size ``size``."""
        b = size
        ids, positions, slots, lens = self._flat[:, :b].unbind(0)
        attn = AttentionMetadata(
            slot_mapping=slots,
            block_tables=self._tables[:b],
            query_start_loc=self._starts[: b + 1],
            seq_lens=lens,
            max_query_len=1,
            max_seq_len=max(seq_lens),
            query_lens_host=[1] * b,
            seq_lens_host=seq_lens,
        )
        return ForwardBatch(
            input_ids=ids, positions=positions, attn=attn, logits_indices=self._starts[:b],
            real_rows=self._real[:b],
        )
