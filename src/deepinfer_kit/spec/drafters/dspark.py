"""DSparkDrafter: semi-autoregressive drafting — one backbone forward per round (the target's
first ``k`` layers over the draft's own paged KV), parallel heads for all γ positions at once,
then the low-rank Markov head and the calibrated confidence head left to right.

Per round and request: roll the backbone's KV back to the tokens it still agrees with
(:class:`~deepinfer_kit.spec.drafters.draft_kv.DraftKVBook`), feed the tokens it has not seen (the
previous round's accepted tokens, a new prompt, a resumed history) in one batched forward
and keep the last hidden state ``h``. The heads (:class:`~deepinfer_kit.spec.drafters.dspark_heads.
DSparkHeads`) turn ``h`` into γ base logits; draft ``k`` is drawn from
``base_k + W1[x_{k-1}]·W2`` under the request's sampling parameters, its confidence is the
STS-calibrated ``σ(wᵀ[h_k; W1[x_{k-1}]] / T_k)``. Drafts never enter the backbone's KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.spec.drafters.rows import DraftRow, OwnKVState, check_draft_pool, plan_rows
from deepinfer_kit.models.packing import last_token_batch
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.truncated import LayerTruncatedLM
from deepinfer_kit.spec.protocols import DraftSequence
from deepinfer_kit.spec.drafters.draft_kv import DraftKVBook
from deepinfer_kit.spec.drafters.draw import draw_drafts
from deepinfer_kit.spec.drafters.dspark_heads import DSparkHeads
from deepinfer_kit.spec.records import DraftProposal

if TYPE_CHECKING:
    from deepinfer_kit.spec.protocols import StatefulDrafter

__all__ = ["DSparkDrafter"]


class DSparkDrafter(OwnKVState):
    """Drafts with DSpark heads above a layer-truncated view of the target (implements
    :class:`~deepinfer_kit.spec.protocols.StatefulDrafter`).

    Args:
        backbone: the target's first ``heads.backbone_layers`` layers.
        heads: the trained heads, on the backbone's device.
        kv_cache: the backbone's own KV pool (its layers only), the target's block size.
        book: per-sequence bookkeeping over ``kv_cache``'s blocks.
        generator: random source of unseeded sampled requests' drafts.
        max_model_len: drafts never reach past it.

    Raises:
        ConfigError: the heads were trained on another depth than the backbone's, or the
            book's pool differs from ``kv_cache``'s.
    """

    def __init__(self, backbone: LayerTruncatedLM, heads: DSparkHeads, kv_cache: PagedKVCache,
                 book: DraftKVBook, *, generator: torch.Generator | None = None,
                 max_model_len: int) -> None:
        if heads.backbone_layers != backbone.num_layers:
            raise ConfigError(
                f"DSpark heads read {heads.backbone_layers} backbone layers, the backbone has "
                f"{backbone.num_layers}"
            )
        check_draft_pool(book, kv_cache, "DSpark")
        self.backbone = backbone
        self.heads = heads
        self.kv_cache = kv_cache
        self.book = book
        self.generator = generator
        self.max_model_len = min(max_model_len, backbone.config.max_position_embeddings)
        self.vocab_size = backbone.config.vocab_size
        self.num_forwards = 0  # backbone forwards run

    def propose(self, requests: Sequence[DraftSequence], num_draft: int) -> DraftProposal:
        """Draft up to ``num_draft`` (γ, at most the heads' positions) tokens per request.

        Mutates the drafter's KV and book: afterwards each drafted request holds the KV of
        exactly its ``all_token_ids``. A request at ``max_model_len`` or whose blocks do not
        fit the pool this round gets no drafts. One backbone forward, γ ``[R, r] x [r, V]``
        Markov matmuls, one device-to-host copy per position.

        Returns:
            ``token_ids [R, γ]`` int64 and ``confidence [R, γ]`` float32 (calibrated,
            conditional on the previous drafts) on the CPU; ``draft_probs [R, γ, V]``
            float64 on the device, or ``None`` when every request is greedy.

        Raises:
            ConfigError: ``num_draft`` exceeds the heads' positions.
        """
        num_req, gamma = len(requests), num_draft
        if gamma > self.heads.num_positions:
            raise ConfigError(f"speculative.num_draft must be <= {self.heads.num_positions} "
                              f"(the DSpark heads' positions), got {gamma}")
        ids = [[0] * gamma for _ in range(num_req)]
        conf = torch.zeros(num_req, gamma, dtype=torch.float32)
        counts = [0] * num_req
        greedy = all(r.params.is_greedy for r in requests)
        probs = None if greedy else torch.zeros(
            num_req, gamma, self.vocab_size, dtype=torch.float64, device=self.kv_cache.device)
        rows = self._plan(requests, gamma)
        if not rows:
            return DraftProposal(torch.zeros(num_req, gamma, dtype=torch.int64), counts,
                                 probs, conf)
        hidden = self._forward(rows)
        with torch.inference_mode():
            states = self.heads.position_states(hidden)  # [n, γ, H]
            base = self.backbone.project(states.flatten(0, 1)).view(len(rows), -1,
                                                                   self.vocab_size)
            prev = torch.tensor([row.req.all_token_ids[-1] for row in rows],
                                device=hidden.device)
            where = torch.tensor([row.index for row in rows], dtype=torch.int64)
            greedy_rows = torch.tensor([row.req.params.is_greedy for row in rows],
                                       device=hidden.device)
            for j in range(gamma):
                e, bias = self.heads.markov(prev)
                tokens, q, _ = draw_drafts(base[:, j] + bias, [row.req for row in rows],
                                           [ids[row.index] for row in rows], j, greedy=greedy,
                                           generator=self.generator)
                # c_j reads x_{j-1} (the Markov feature), never x_j: non-anticipating
                c = self.heads.confidence(states[:, j], e, j, greedy_rows).cpu()
                for row, tok in zip(rows, tokens):
                    ids[row.index][j] = tok
                conf[where, j] = c
                if probs is not None and q is not None:
                    probs[where.to(probs.device), j] = q
                prev = torch.tensor(tokens, device=hidden.device)
        for row in rows:
            counts[row.index] = row.depth
            conf[row.index, row.depth:] = 0.0
        return DraftProposal(torch.tensor(ids, dtype=torch.int64).view(num_req, gamma), counts,
                             probs, conf)

    def _plan(self, requests: Sequence[DraftSequence], gamma: int) -> list[DraftRow]:
        """The requests that draft this round, their KV rolled back and reserved."""
        return plan_rows(self.book, requests, gamma, self.max_model_len, lambda n, depth: n)

    def _forward(self, rows: list[DraftRow]) -> torch.Tensor:
        """One backbone forward over each row's unseen tokens; ``[n, H]`` last hidden
        states. Records the rows' tokens as written."""
        lens = [len(row.req.all_token_ids) for row in rows]
        query_lens = [n - row.start for row, n in zip(rows, lens)]
        forward = last_token_batch(
            [t for row in rows for t in row.req.all_token_ids[row.start:]],
            [p for row, n in zip(rows, lens) for p in range(row.start, n)],
            query_lens, lens, [row.table for row in rows],
            block_size=self.kv_cache.block_size, device=self.kv_cache.device,
        )  # fmt: skip
        self.num_forwards += 1
        hidden = self.backbone.hidden(forward, self.kv_cache)
        for row in rows:
            self.book.written(row.req.request_id, row.req.all_token_ids)
        return hidden


if TYPE_CHECKING:
    _check: type[StatefulDrafter] = DSparkDrafter
