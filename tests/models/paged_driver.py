"""Test-side engine stand-in: lays out ForwardBatches over a PagedKVCache for model tests.

Holds a free list of blocks, per-sequence block tables, and runs greedy generation with
chunked prefill, mixed prefill/decode steps and prefix-cache hits (a new sequence reusing
another's full blocks), so model outputs can be compared with ``transformers``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import attrs
import pytest
import torch

from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.models.attention import make_attention_metadata
from deepinfer_kit.models.causal_lm import TransformerCausalLM
from deepinfer_kit.models.records import ForwardBatch


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny matmuls: extra threads only add contention on a shared 2-core machine.

    Use in a test module with ``pytestmark = pytest.mark.usefixtures("one_thread")``.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@attrs.define
class Seq:
    """One sequence: its tokens so far, block table, and how many tokens have KV."""

    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    table: list[int] = attrs.field(factory=list)
    computed: int = 0
    start_step: int = 0

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.max_new_tokens


class PagedDriver:
    """Runs a model step by step over its own block pool."""

    def __init__(self, model: TransformerCausalLM, *, num_blocks: int = 128, block_size: int = 4,
                 kv_impl: str = "ref") -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        row = cfg.cache_row()  # K/V heads, or DeepSeek-V3's keys-only latent row
        self.cache = PagedKVCache(cfg.num_layers, num_blocks, block_size, row.num_heads, row.head_dim,
                                  dtype=model.dtype, impl=kv_impl,  # type: ignore[arg-type]
                                  keys_only=row.keys_only)
        # Hand out blocks in a scrambled order so tables are not contiguous ranges.
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
        self.free: list[int] = order

    def new_seq(self, prompt: Sequence[int], max_new_tokens: int, *, prefix_of: Seq | None = None,
                prefix_blocks: int = 0, start_step: int = 0) -> Seq:
        """A sequence; with ``prefix_of`` it reuses that sequence's first ``prefix_blocks`` full
        blocks (a prefix-cache hit: their tokens must equal this prompt's)."""
        seq = Seq(tokens=list(prompt), prompt_len=len(prompt), max_new_tokens=max_new_tokens,
                  start_step=start_step)
        if prefix_of is not None and prefix_blocks:
            shared = prefix_blocks * self.block_size
            assert prefix_of.computed >= shared, "prefix blocks must be written first"
            assert prefix_of.tokens[:shared] == seq.tokens[:shared], "prefix tokens differ"
            seq.table = prefix_of.table[:prefix_blocks]
            seq.computed = shared
        return seq

    def _grow(self, seq: Seq, num_tokens: int) -> None:
        while len(seq.table) * self.block_size < num_tokens:
            seq.table.append(self.free.pop())

    def forward(self, chunks: Sequence[tuple[Seq, int]], *, all_logits: bool = False) -> torch.Tensor:
        """One step computing the next ``n`` tokens of each ``(seq, n)``; advances ``computed``.

        Returns the logits of each chunk's last token ``[R, V]`` (every row when
        ``all_logits``).
        """
        ids: list[int] = []
        positions: list[int] = []
        for seq, n in chunks:
            self._grow(seq, seq.computed + n)
            ids += seq.tokens[seq.computed:seq.computed + n]
            positions += range(seq.computed, seq.computed + n)
        meta = make_attention_metadata(
            [n for _, n in chunks], [s.computed + n for s, n in chunks],
            [s.table for s, _ in chunks], self.block_size)
        ends = torch.tensor([n for _, n in chunks]).cumsum(0) - 1
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            attn=meta,
            logits_indices=torch.arange(len(ids)) if all_logits else ends,
        )
        logits = self.model.forward(batch, self.cache)
        for seq, n in chunks:
            seq.computed += n
        return logits

    def generate(self, seqs: Sequence[Seq], *, chunk: int = 1 << 30) -> list[list[int]]:
        """Greedy decoding of every sequence together until each has its new tokens.

        A sequence joins at its ``start_step``; its prompt is prefilled ``chunk`` tokens per
        step alongside the other sequences' decodes.
        """
        step = 0
        while not all(s.done for s in seqs):
            chunks = []
            for seq in seqs:
                if seq.done or seq.start_step > step:
                    continue
                remaining = len(seq.tokens) - seq.computed
                chunks.append((seq, min(chunk, remaining)))
            if chunks:
                logits = self.forward(chunks)
                for (seq, _), row in zip(chunks, logits):
                    if seq.computed == len(seq.tokens):
                        seq.tokens.append(int(row.argmax()))
            step += 1
        return [s.generated for s in seqs]
