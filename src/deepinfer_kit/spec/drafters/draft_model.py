"""DraftModelDrafter: a small causal LM (or a layer-truncated view of the target) drafts γ
tokens per request autoregressively, over paged KV blocks of its own.

Each round, for every request: roll the drafter's KV back to the tokens it still agrees
with (:class:`~deepinfer_kit.spec.drafters.draft_kv.DraftKVBook`), then one batched forward
computes the tokens it has not seen (catch-up prefill: the emitted token of the last
round, a new request's whole prompt, a resumed request's history) and draws the first
draft; ``γ - 1`` batched one-token forwards draw the others. Drafts are drawn from the
draft model's distribution under each request's own sampling parameters (``q``, kept as
``draft_probs`` for strict rejection sampling); greedy requests draft the argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.spec.drafters.rows import DraftRow, OwnKVState, check_draft_pool, plan_rows
from deepinfer_kit.models.packing import last_token_batch
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.protocols import CausalLM
from deepinfer_kit.spec.protocols import DraftSequence
from deepinfer_kit.spec.drafters.draft_kv import DraftKVBook
from deepinfer_kit.spec.records import DraftProposal
from deepinfer_kit.spec.drafters.draw import draw_drafts

if TYPE_CHECKING:
    from deepinfer_kit.spec.protocols import StatefulDrafter

__all__ = ["DraftModelDrafter"]

class DraftModelDrafter(OwnKVState):
    """Drafts with a causal LM over its own paged KV (implements
    :class:`~deepinfer_kit.spec.protocols.StatefulDrafter`).

    Args:
        model: the draft model (any :class:`CausalLM` sharing the target's vocabulary:
            a small checkpoint, or ``models.truncated.LayerTruncatedLM`` of the target).
        kv_cache: the draft's own KV pool, one layer per draft layer, the target's block
            size; written only by this drafter.
        book: per-sequence bookkeeping over the allocator of ``kv_cache``'s blocks.
        generator: random source of unseeded sampled requests' drafts (on the model's
            device); ``None`` uses torch's default generator.
        max_model_len: positions the draft may write stay below it (the draft model's
            ``max_position_embeddings`` at most).
        stop_below: stop drafting a request at the first draft whose confidence makes it
            fall below this (``stop_rule``): the threshold planner would not verify it nor
            any after it, so it is not drawn and the forwards after it are saved. 0 drafts
            all ``γ``. The confidence is known before the draft is drawn
            (:func:`~deepinfer_kit.spec.drafters.draw.draft_confidence`), so the stop never reads
            the drafted value.
        stop_rule: ``"survival"`` compares the cumulative product of the confidences with
            ``stop_below``, ``"step"`` each draft's own (the threshold planner's rules).

    Raises:
        ConfigError: the book's block size or pool differs from ``kv_cache``'s, or the
            cache has fewer layers than the model.
    """

    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, book: DraftKVBook, *,
                 generator: torch.Generator | None = None, max_model_len: int,
                 stop_below: float = 0.0, stop_rule: str = "survival") -> None:
        check_draft_pool(book, kv_cache, "draft")
        if kv_cache.num_layers < model.config.num_layers:
            raise ConfigError(
                f"draft KV holds {kv_cache.num_layers} layers, the draft model has "
                f"{model.config.num_layers}"
            )
        self.model = model
        self.kv_cache = kv_cache
        self.book = book
        self.generator = generator
        self.max_model_len = min(max_model_len, model.config.max_position_embeddings)
        self.vocab_size = model.config.vocab_size
        self.stop_below = stop_below
        self.stop_rule = stop_rule
        self.num_forwards = 0  # draft forwards run (catch-up rounds included)

    def propose(self, requests: Sequence[DraftSequence], num_draft: int) -> DraftProposal:
        """Draft up to ``num_draft`` (γ) tokens after each request's ``all_token_ids``.

        Mutates the drafter's KV and book: afterwards each drafted request holds the KV
        of its tokens plus its first ``num_drafted - 1`` drafts. A request whose next
        positions pass ``max_model_len``, or whose blocks do not fit the draft pool this
        round, gets fewer (or no) drafts. At most ``γ`` forwards, each one device-to-host
        copy of ``R`` tokens.

        Returns:
            ``token_ids [R, γ]`` int64 and ``confidence [R, γ]`` float32 (the draft
            model's expected probability of the draft it is about to draw, temperature 1:
            :func:`~deepinfer_kit.spec.drafters.draw.draft_confidence`) on the CPU;
            ``draft_probs [R, γ, V]`` float64 on the model's device (the distribution each
            draft was drawn from; zeros past ``num_drafted``), or ``None`` when every
            request is greedy (one-hot drafts).
        """
        num_req, gamma = len(requests), num_draft
        ids = [[0] * gamma for _ in range(num_req)]
        conf = torch.zeros(num_req, gamma, dtype=torch.float32)
        greedy = all(r.params.is_greedy for r in requests)
        probs = None if greedy else torch.zeros(
            num_req, gamma, self.vocab_size, dtype=torch.float64, device=self.kv_cache.device)
        rows = self._plan(requests, gamma)
        for j in range(gamma):
            step = [row for row in rows if row.depth > j]
            if not step:
                break
            logits = self._forward(step, ids, j)
            for row in step:
                row.fed = j  # the KV of drafts 0 .. j - 1 is now written
            tokens, q, c = draw_drafts(logits, [row.req for row in step],
                                       [ids[row.index] for row in step], j, greedy=greedy,
                                       generator=self.generator)
            kept = []
            for k, (row, tok, cj) in enumerate(zip(step, tokens, c.tolist())):
                row.survival *= cj
                if self._stops(row.survival, cj):
                    row.depth = j  # the planner verifies no draft from here: keep none
                    continue
                ids[row.index][j] = tok
                kept.append(k)
            if not kept:
                continue
            where = torch.tensor([step[k].index for k in kept], dtype=torch.int64)
            pick = torch.tensor(kept, dtype=torch.int64)
            conf[where, j] = c[pick]
            if probs is not None and q is not None:
                probs[where.to(probs.device), j] = q[pick.to(q.device)]
        for row in rows:
            toks = row.req.all_token_ids
            self.book.written(row.req.request_id, toks + ids[row.index][: row.fed])
        counts = [0] * num_req
        for row in rows:
            counts[row.index] = row.depth
        return DraftProposal(
            token_ids=torch.tensor(ids, dtype=torch.int64).view(num_req, gamma),
            num_drafted=counts, draft_probs=probs, confidence=conf,
        )

    def _stops(self, survival: float, confidence: float) -> bool:
        """Whether a draft of this ``survival`` / own ``confidence`` is below the stop."""
        if self.stop_below <= 0:
            return False
        value = confidence if self.stop_rule == "step" else survival
        return value < self.stop_below

    # ---- one round -----------------------------------------------------------------

    def _plan(self, requests: Sequence[DraftSequence], gamma: int) -> list[DraftRow]:
        """The requests that draft this round, their KV rolled back and reserved."""
        return plan_rows(self.book, requests, gamma, self.max_model_len, lambda n, depth: n + depth - 1)

    def _forward(self, step: list[DraftRow], ids: list[list[int]], j: int) -> torch.Tensor:
        """Draft step ``j``: the catch-up tokens (``j == 0``) or draft ``j - 1`` of each
        row; returns ``[len(step), V]`` logits after each row's last fed token."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        for row in step:
            toks = row.req.all_token_ids
            n = len(toks)
            if j == 0:
                input_ids += toks[row.start:]
                positions += range(row.start, n)
                query_lens.append(n - row.start)
                seq_lens.append(n)
            else:
                input_ids.append(ids[row.index][j - 1])
                positions.append(n - 1 + j)
                query_lens.append(1)
                seq_lens.append(n + j)
        forward = last_token_batch(
            input_ids, positions, query_lens, seq_lens, [row.table for row in step],
            block_size=self.kv_cache.block_size, device=self.kv_cache.device,
        )  # fmt: skip
        self.num_forwards += 1
        with torch.inference_mode():
            return self.model(forward, self.kv_cache)


if TYPE_CHECKING:
    _check: type[StatefulDrafter] = DraftModelDrafter
