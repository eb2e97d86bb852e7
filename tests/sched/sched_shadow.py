"""Test helpers: a fake model whose "KV" lives in slots addressed by the block tables,
and a spy KV cache manager that records the calls the scheduler makes.

:class:`SlotModel` emulates what matters about a real model for a scheduler: the KV of
position ``p`` is a hash of the KV of ``p - 1`` (read back from its slot) and token
``p``, and a sampled token is a hash of the last KV. So a block freed while in use, a
prefix published before it was written, a missed copy-on-write, or a recompute that
forgot tokens changes the outputs (and is caught at once by :meth:`SlotModel.verify`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from deepinfer_kit.cache.manager import BlockKVCacheManager
from deepinfer_kit.cache.protocols import KVCacheManager
from deepinfer_kit.cache.records import PrefixCacheStats
from deepinfer_kit.request import Request
from deepinfer_kit.sched.records import ScheduledChunk, SchedulePlan
from deepinfer_kit.step import StepResult


def kv_chain(tokens: Sequence[int]) -> list[int]:
    """The KV values a correct run writes for ``tokens`` at positions 0..len-1."""
    out, prev = [], 0
    for tok in tokens:
        prev = hash((prev, tok))
        out.append(prev)
    return out


def token_from(kv: int, j: int, vocab: int) -> int:
    """Sample ``j`` drawn from the logits at a position whose KV is ``kv`` (0 is EOS)."""
    return hash((kv, j, 0x5EED)) % vocab


def greedy_continuation(tokens: Sequence[int], length: int, vocab: int) -> list[int]:
    """The next ``length`` tokens a correct run samples after ``tokens`` (sample 0)."""
    seq = list(tokens)
    prev = kv_chain(seq)[-1]
    out = []
    for _ in range(length):
        tok = token_from(prev, 0, vocab)
        out.append(tok)
        prev = hash((prev, tok))
    return out


class SlotModel:
    """The fake step: writes chain KV into slots, samples from the last one.

    Handles block copies, non-final prefill chunks (``[]``), forks (``num_samples``
    tokens), placeholders (the token its previous call sampled for the request) and
    speculative chunks: a decode with ``draft_room`` gets the drafts ``draft(request,
    room)`` proposes (the runner's job), fed after its token and verified greedily
    (accepted while they equal what the model samples, then one more token); the result
    reports them (``drafts``, ``num_drafted``) as the runner's does.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        lookup: Callable[[str], Request | None],
        vocab: int = 50,
        draft: Callable[[Request, int], list[int]] | None = None,
    ) -> None:
        self.P = block_size
        self.vocab = vocab
        self.lookup = lookup  # the live sequence of a chunk, for the KV check only
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.pending: dict[str, int] = {}  # sequence id -> its token sampled last call
        self.draft = draft

    def _slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.P] * self.P + pos % self.P

    def __call__(self, plan: SchedulePlan) -> StepResult:
        P = self.P
        for src, dst in plan.block_copies:
            self.slots[dst * P : (dst + 1) * P] = self.slots[src * P : (src + 1) * P]
        out: list[list[int]] = []
        drafts: list[tuple[int, ...]] = []
        for chunk in plan.all_chunks():
            toks, spec = self._run(chunk)
            out.append(toks)
            drafts.append(spec)
        if any(drafts):
            return StepResult(out, num_drafted=[len(d) for d in drafts], drafts=drafts)
        return StepResult(out)

    def _run(self, c: ScheduledChunk) -> tuple[list[int], tuple[int, ...]]:
        req = self.lookup(c.request_id)
        assert req is not None, f"{c.request_id} scheduled but not live"
        table = c.block_table  # the plan's snapshot: the model never reads the request's
        self.verify(req, table, c.start)
        n_known = c.num_tokens - c.draft_room
        fed = list(c.token_ids)
        if c.num_placeholders:
            fed.append(self.pending[c.request_id])
        assert len(fed) == n_known
        spec: tuple[int, ...] = ()
        if c.draft_room and self.draft is not None:
            spec = tuple(self.draft(req, c.draft_room)[: c.draft_room])
        fed += spec
        prev = self.slots[self._slot(table, c.start - 1)] if c.start else 0
        assert prev is not None, f"{c.request_id}: KV at {c.start - 1} never written"
        kvs = []
        for i, tok in enumerate(fed):
            prev = hash((prev, tok))
            self.slots[self._slot(table, c.start + i)] = prev
            kvs.append(prev)
        if not c.sample:
            return [], spec
        if spec:
            toks = []
            for i in range(len(spec) + 1):
                toks.append(token_from(kvs[n_known - 1 + i], 0, self.vocab))
                if i == len(spec) or toks[-1] != spec[i]:
                    break
            return toks, spec
        toks = [token_from(kvs[n_known - 1], j, self.vocab) for j in range(c.num_samples)]
        self.pending[c.request_id] = toks[0]
        return toks, spec

    def verify(self, req: Request, table: list[int], end: int) -> None:
        """The KV read back through ``table`` for ``req``'s known positions below ``end``
        equals what a correct run wrote."""
        end = min(end, len(req.all_token_ids))
        want = kv_chain(req.all_token_ids[:end])
        got = [self.slots[self._slot(table, p)] for p in range(end)]
        bad = [p for p in range(end) if got[p] != want[p]]
        assert not bad, f"{req.request_id}: KV corrupt at positions {bad[:8]} (table {table})"


class SpyCache:
    """A KVCacheManager that forwards to a real one and logs every call as
    ``(method, request, args, result)``."""

    def __init__(self, inner: BlockKVCacheManager) -> None:
        self.inner = inner
        self.log: list[tuple[str, Request, tuple[Any, ...], Any]] = []

    @property
    def block_size(self) -> int:
        return self.inner.block_size

    @property
    def num_blocks(self) -> int:
        return self.inner.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.inner.num_free_blocks

    @property
    def stats(self) -> PrefixCacheStats | None:
        return self.inner.stats

    def check_integrity(self, requests: Iterable[Request] | None = None) -> None:
        self.inner.check_integrity(requests)

    def _call(self, name: str, req: Request, *args: Any) -> Any:
        result = getattr(self.inner, name)(req, *args)
        self.log.append((name, req, args, result))
        return result

    def match_prefix(self, request: Request) -> int:
        return int(self._call("match_prefix", request))

    def can_allocate(
        self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0
    ) -> bool:
        return bool(self._call("can_allocate", request, num_new_tokens, num_cached_tokens))

    def allocate(
        self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0
    ) -> list[tuple[int, int]]:
        table_before = len(request.block_table)
        copies: list[tuple[int, int]] = self._call(
            "allocate", request, num_new_tokens, num_cached_tokens
        )
        self.log[-1] = (
            "allocate",
            request,
            (num_new_tokens, num_cached_tokens, table_before),
            copies,
        )
        return copies

    def allocate_next_blocks(self, requests: Sequence[Request]) -> int:
        # Logged as the allocate calls it stands for (one block each, no copies).
        before = [len(r.block_table) for r in requests]
        k = self.inner.allocate_next_blocks(requests)
        for req, table_before in zip(requests[:k], before):
            self.log.append(("allocate", req, (1, 0, table_before), []))
        return k

    def fork(self, parent: Request, child: Request) -> None:
        self._call("fork", parent, child)

    def truncate(self, request: Request, num_tokens: int) -> None:
        self._call("truncate", request, num_tokens)

    def free(self, request: Request) -> None:
        self._call("free", request)

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        self._call("cache_full_blocks", request, num_tokens)

    def reset_prefix_cache(self) -> bool:
        return self.inner.reset_prefix_cache()


if TYPE_CHECKING:
    _check: type[KVCacheManager] = SpyCache
