"""SyntheticTokens: the seeded stand-in for a model's sampled tokens, and prompt tokens.

A request's output is fixed by its id and the position alone — whatever the batch,
preemptions or the step it runs in — so runs are reproducible and a real engine given the
same stand-in (see ``tests/sim``) makes the same decisions.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sched.records import ScheduledChunk, SchedulePlan

__all__ = ["SyntheticTokens", "token_stream", "request_base"]

_STRIDE = 40503  # an odd stride: consecutive positions differ


def request_base(seed: int, request_id: str) -> int:
    """A 64-bit integer fixed by ``(seed, request_id)`` (BLAKE2b, not ``hash()``, so it
    is the same in every process). Pure."""
    digest = hashlib.blake2b(f"{seed}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def token_stream(key: str, n: int, vocab_size: int) -> list[int]:
    """``n`` token ids in ``[0, min(vocab_size, 65536))`` drawn from SHAKE-128 of ``key``:
    the same key gives the same ids in every process. Pure; O(n), in C but for the
    final list (and the modulo when the vocabulary is smaller than 65536)."""
    raw = array("H", hashlib.shake_128(key.encode()).digest(2 * n))
    if vocab_size >= 1 << 16:
        return raw.tolist()
    return [t % vocab_size for t in raw]


class SyntheticTokens:
    """Tokens a synthetic model samples: request ``r``'s output position ``p`` is a fixed
    non-EOS id, except the last position of a request registered to stop by EOS, which
    is ``eos_token_id``.

    Args:
        vocab_size: ids lie in ``[0, vocab_size)``.
        eos_token_id: never produced except as a registered stop; ``None``: no EOS.
        seed: varies every request's tokens.

    Raises:
        ConfigError: ``vocab_size`` < 2 or ``eos_token_id`` outside the vocabulary.
    """

    __slots__ = ("vocab_size", "eos_token_id", "seed", "_plans", "_span")

    def __init__(self, vocab_size: int, eos_token_id: int | None, seed: int = 0) -> None:
        if vocab_size < 2:
            raise ConfigError(f"vocab_size must be >= 2, got {vocab_size}")
        if eos_token_id is not None and not 0 <= eos_token_id < vocab_size:
            raise ConfigError(f"eos_token_id must lie in [0, {vocab_size}), got {eos_token_id}")
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.seed = seed
        self._span = vocab_size - 1 if eos_token_id is not None else vocab_size
        # request id -> (base, position of the EOS token or -1)
        self._plans: dict[str, tuple[int, int]] = {}

    def register(self, request_id: str, output_len: int, stop_by_eos: bool, first: int = 0) -> None:
        """Fix ``request_id``'s output: ``output_len`` tokens, the last one EOS when
        ``stop_by_eos`` (and an EOS id exists). With ``first`` > 0 the request's position
        ``p`` is the stream's position ``first + p`` (a decode instance continuing a
        request whose first ``first`` tokens were sampled elsewhere; ``output_len``
        counts the whole stream). Mutates the registry; O(1)."""
        eos_at = output_len - 1 - first if stop_by_eos and self.eos_token_id is not None else -1
        self._plans[request_id] = (request_base(self.seed, request_id) + first * _STRIDE, eos_at)

    def forget(self, request_id: str) -> None:
        """Drop ``request_id``'s entry (after it finished); unknown ids are ignored."""
        self._plans.pop(request_id, None)

    def token(self, request_id: str, position: int) -> int:
        """The token at output ``position`` of ``request_id`` (an unregistered id is
        registered with no EOS). Mutates the registry only for a new id; O(1)."""
        plan = self._plans.get(request_id)
        if plan is None:
            plan = self._plans[request_id] = (request_base(self.seed, request_id), -1)
        base, eos_at = plan
        if position == eos_at:
            assert self.eos_token_id is not None
            return self.eos_token_id
        t = (base + position * _STRIDE) % self._span
        eos = self.eos_token_id
        return t + 1 if eos is not None and t >= eos else t

    def tokens(self, request_id: str, first: int, count: int) -> list[int]:
        """The tokens at output positions ``first .. first + count - 1`` of
        ``request_id``: ``[token(request_id, p) for p in range(first, first + count)]``
        in one pass (a stretch of plain-decode rounds). Registers an unknown id as
        :meth:`token` does; O(count)."""
        plan = self._plans.get(request_id)
        if plan is None:
            return [self.token(request_id, p) for p in range(first, first + count)]
        base, eos_at = plan
        span, eos = self._span, self.eos_token_id
        begin = base + first * _STRIDE  # position p's token is (base + p * STRIDE) % span
        out = [x % span for x in range(begin, begin + count * _STRIDE, _STRIDE)]
        if eos is not None:
            if eos < span:  # ids at or above EOS move up one (none do when EOS is the last id)
                out = [t + 1 if t >= eos else t for t in out]
            if first <= eos_at < first + count:
                out[eos_at - first] = eos
        return out

    def plan_tokens(self, plan: SchedulePlan) -> list[list[int]]:
        """A round's sampled tokens in batch order: one :meth:`token` per decode row
        (``plan.decodes``), then :meth:`round_tokens` of ``plan.chunks``. Registers
        unknown ids as :meth:`token` does; O(chunks)."""
        rows = plan.decodes
        token = self.token
        out = [[token(rid, pos)] for rid, pos in zip(rows.request_ids, rows.output_positions)]
        if plan.chunks:
            out += self.round_tokens(plan.chunks)
        return out

    def round_tokens(self, chunks: Sequence[ScheduledChunk]) -> list[list[int]]:
        """A round's sampled tokens, one list per chunk: empty for a non-final prefill
        chunk, else ``num_samples`` tokens (completion ``i > 0`` of a fork is keyed by
        the child's id ``"{id}#{i}"``), each :meth:`token` of the chunk's output position.
        Registers unknown ids as :meth:`token` does; O(chunks), one call per round."""
        plans = self._plans
        span = self._span
        eos = self.eos_token_id
        token = self.token
        out: list[list[int]] = []
        for chunk in chunks:
            if not chunk.sample:
                out.append([])
                continue
            rid, pos = chunk.request_id, chunk.output_position
            plan = plans.get(rid)
            if chunk.num_samples != 1 or plan is None:
                out.append([token(rid if i == 0 else f"{rid}#{i}", pos)
                            for i in range(chunk.num_samples)])
                continue
            base, eos_at = plan  # token(), inlined: it runs once per simulated token
            if pos == eos_at:
                assert eos is not None
                out.append([eos])
                continue
            t = (base + pos * _STRIDE) % span
            out.append([t + 1 if eos is not None and t >= eos else t])
        return out

    def output(self, request_id: str, length: int) -> Sequence[int]:
        """The first ``length`` output tokens of ``request_id`` (see :meth:`token`)."""
        return [self.token(request_id, p) for p in range(length)]
