"""The runner's structured-output stage: every sampling row under a grammar gets the
grammar's allowed next tokens as a bitmask, applied to its logits on the device before the
logit edits, the sampler, the verifier and the logprobs (so logprobs are those of the
constrained distribution, as vLLM reports them).

A row's matcher state is a function of the row's token history alone: the stage keeps one
matcher per sequence and, at each step, moves it to the row's history (rolls back to the
common prefix, accepts the rest). So nothing depends on when the engine commits a token:
under overlap the history of a row whose previous token is still in flight is completed on
the host from that step's result (``SamplingRow.needs_history``: the runner's placeholder
rows), a verify row's history holds the drafts before it (one mask per draft position; a
draft the grammar refuses has probability 0, so the verifier rejects it and the rows after
it are never used), a preempted and recomputed sequence, or a fork's child, reaches its
state by replay. Matchers of sequences absent from a step are dropped (a later step
replays them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sample.structured.bitmask import allocate_bitmask, apply_bitmask
from deepinfer_kit.sample.structured.protocols import CompiledGrammar, GrammarBackend, GrammarMatcher
from deepinfer_kit.sample.structured.params import StructuredOutputsParams

__all__ = ["GrammarStage", "MAX_ROLLBACK"]

MAX_ROLLBACK = 1 << 16
"""Tokens a matcher may roll back before the stage replays its sequence from the start."""


@attrs.define(slots=True, eq=False)
class _Tracked:
    spec: StructuredOutputsParams
    matcher: GrammarMatcher
    accepted: list[int]  # the history the matcher stands at


class GrammarStage:
    """Masks the rows of a step that carry ``structured_outputs``.

    Args:
        backend: builds the grammar backend on first use (so a model served without
            structured outputs never imports xgrammar); its ``vocab_size`` must cover the
            logits' width.
        pin_memory: stage the bitmask in pinned host memory (CUDA).
    """

    def __init__(self, backend: Callable[[], GrammarBackend], *, pin_memory: bool = False) -> None:
        self._make_backend = backend
        self._backend: GrammarBackend | None = None
        self._compiled: dict[StructuredOutputsParams, CompiledGrammar] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._pin = pin_memory

    @property
    def backend(self) -> GrammarBackend:
        """The grammar backend (built on first use)."""
        if self._backend is None:
            self._backend = self._make_backend()
        return self._backend

    def apply(self, logits: torch.Tensor, rows: Sequence[tuple[int, str]], params: Sequence[SamplingParams],
              histories: Sequence[Sequence[int]]) -> torch.Tensor:
        """Mask ``logits`` in place: row ``r`` of each ``(r, sequence id)`` in ``rows`` keeps
        only the tokens its grammar allows after ``histories[r]``.

        Called by the runner's launch with the step's finite float32 logits ``[N, V]``
        (any device) before the logit edits and the sampler. Mutates ``logits`` and the
        stage's matchers; the bitmask goes to the device in one copy (no host read).

        Returns:
            ``[N]`` bool on the logits' device: False for a row the grammar leaves no token
            (every logit masked: a grammar that cannot go on, e.g. EOS withheld by
            ``min_tokens`` where only EOS may come); the runner reports it as an error.

        Raises:
            StructuredOutputError: a spec that does not compile (the engine compiles each
                spec when the request arrives, so this is not expected here).
        """
        backend = self.backend
        bitmask = allocate_bitmask(len(rows), backend.vocab_size, pin_memory=self._pin)
        current: dict[str, _Tracked] = {}
        for i, (r, sid) in enumerate(rows):
            spec = params[r].structured_outputs
            assert spec is not None  # layout lists only rows with a spec
            tracked = current.get(sid) or self._tracked.get(sid)
            if tracked is None or (tracked.spec is not spec and tracked.spec != spec):
                tracked = _Tracked(spec, backend.matcher(self.compiled(spec), max_rollback=MAX_ROLLBACK), [])
            current[sid] = tracked
            if _move_to(tracked, histories[r]):
                tracked.matcher.fill_bitmask(bitmask, i)
        self._tracked = current
        # grammars only of the specs still tracked: a server meets unboundedly many specs
        live = {t.spec for t in current.values()}
        self._compiled = {spec: g for spec, g in self._compiled.items() if spec in live}
        index = torch.tensor([r for r, _ in rows], dtype=torch.int64)
        if self._pin:  # a pageable host tensor's copy would make the host wait
            index = index.pin_memory()
        apply_bitmask(logits, bitmask, index)  # both copied to the device there, non-blocking
        return logits.amax(dim=-1) > float("-inf")

    def compiled(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of ``spec``, kept while a tracked sequence uses it (a backend
        need not cache; xgrammar's does, bounded). Raises ``StructuredOutputError`` for a
        spec that does not compile."""
        grammar = self._compiled.get(spec)
        if grammar is None:
            grammar = self._compiled[spec] = self.backend.compile(spec)
        return grammar


def _move_to(tracked: _Tracked, history: Sequence[int]) -> bool:
    """Move ``tracked``'s matcher to ``history``: roll back to the common prefix (or reset
    and replay when that is past ``max_rollback``), then accept the rest. False when the
    grammar refuses a token of ``history`` (a draft it does not allow): the matcher stays
    at the last allowed prefix, and the row is left unmasked (its draws are never used)."""
    accepted = tracked.accepted
    if len(history) >= len(accepted) and list(history[:len(accepted)]) == accepted:
        common = len(accepted)  # the usual step: the history only grew
    else:
        common = 0
        limit = min(len(accepted), len(history))
        while common < limit and accepted[common] == history[common]:
            common += 1
    drop = len(accepted) - common
    if drop > tracked.matcher.max_rollback:
        tracked.matcher.reset()
        del accepted[:]
        common = 0
    elif drop:
        tracked.matcher.rollback(drop)
        del accepted[common:]
    for token in history[common:]:
        if not tracked.matcher.accept_token(int(token)):  # refused: the state is unchanged
            return False
        accepted.append(int(token))
    return True

