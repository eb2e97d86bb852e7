"""Prompt logprobs: the extra logits rows a prefill chunk of a request with
``prompt_logprobs`` asks the forward for, and their logprob maps after it."""

from __future__ import annotations

import attrs
import torch

from deepinfer_kit._staging import to_device
from deepinfer_kit.engine.runner.step_outputs import asked_top
from deepinfer_kit.outputs import Logprob
from deepinfer_kit.sample.logprobs import row_logsumexp
from deepinfer_kit.sched.records import ScheduledChunk

__all__ = ["PromptMaps", "PromptRows"]


@attrs.define(slots=True, eq=False)
class PromptRows:
    """The prompt-logprob rows of one step, laid out by the runner's ``prepare``.

    Attributes:
        rows: batch token index of each row (appended to the forward's logits indices
            after the sampling rows).
        targets: per row, the prompt token whose logprob it gives (the next one).
        chunks: ``(chunk index, rows, top)`` per chunk with rows, in row order.
    """

    rows: list[int] = attrs.field(factory=list)
    targets: list[int] = attrs.field(factory=list)
    chunks: list[tuple[int, int, int]] = attrs.field(factory=list)

    def add(self, index: int, chunk: ScheduledChunk, first_token: int) -> None:
        """Add the rows of plan chunk ``index`` whose tokens start at batch index
        ``first_token``. Host only; O(rows)."""
        count = len(chunk.prompt_targets)
        if not count:
            return
        base = first_token + chunk.prompt_first - chunk.start
        self.rows.extend(range(base, base + count))
        self.targets.extend(chunk.prompt_targets)
        self.chunks.append((index, count, chunk.prompt_top))

    def split(
        self, logits: torch.Tensor, num_sampled: int, num_chunks: int
    ) -> tuple[torch.Tensor, PromptMaps | None]:
        """``(sampling rows' logits, prompt logprob maps to build or None)`` of the
        forward's ``[num_sampled + len(rows), V]`` logits (called by the runner's
        ``launch``): the maps' device work is queued here, their host read and the dicts
        wait for :meth:`PromptMaps.build` (the runner's ``finish``)."""
        if not self.rows:
            return logits, None
        return logits[:num_sampled], self.queue(logits[num_sampled:], num_chunks)

    def maps(self, logits: torch.Tensor, num_chunks: int) -> list[list[dict[int, Logprob]]]:
        """:meth:`queue` then :meth:`PromptMaps.build`: per plan chunk, the logprob map
        of each of its rows (see :meth:`queue`)."""
        return self.queue(logits, num_chunks).build()

    def queue(self, logits: torch.Tensor, num_chunks: int) -> PromptMaps:
        """Queue the device work of the rows' logprob maps: the target's logprob and rank
        under the raw logits plus the top ``prompt_logprobs`` alternatives.

        Args:
            logits: ``[len(rows), V]`` raw logits of the rows (any device); not mutated.
            num_chunks: chunks of the plan (chunks without rows get ``[]``).

        Each row's asked top only (see
        :func:`~deepinfer_kit.engine.runner.step_outputs.asked_top`); nothing is read
        back here. A row whose logits are all ``-inf`` reports ``-inf``, never NaN.
        """
        x = logits.to(torch.float32)
        lse = row_logsumexp(x)[:, None]
        target = to_device(self.targets, torch.int64, x.device)
        chosen = x.gather(1, target[:, None])
        ranks = (x > chosen).sum(dim=-1) + 1
        top = min(max(k for _, _, k in self.chunks), x.shape[1])
        values, ids = torch.topk(x, top, dim=-1, sorted=True)
        wants = [want for _, count, want in self.chunks for _ in range(count)]
        flat_ids, flat_lp, starts = asked_top(ids, values - lse, wants)
        return PromptMaps(self, num_chunks, torch.cat([ranks, flat_ids]),
                          torch.cat([(chosen - lse)[:, 0], flat_lp]), starts)


@attrs.define(slots=True, eq=False)
class PromptMaps:
    """The queued prompt-logprob work of one step (:meth:`PromptRows.queue`): device
    tensors of the rows' ranks and asked tops, turned into maps on the host by
    :meth:`build`."""

    rows: PromptRows
    num_chunks: int
    ints: torch.Tensor  # [R + sum(asked)] ranks, then the asked top ids row after row
    floats: torch.Tensor  # [R + sum(asked)] the targets' logprobs, then the asked tops'
    starts: list[int]  # [R + 1] each row's start in the asked tops

    def build(self) -> list[list[dict[int, Logprob]]]:
        """Per plan chunk, the logprob map of each of its rows (two copies back to the
        host, waiting for the step's device work). Host loop O(rows + asked)."""
        rows = self.rows
        ints: list[int] = self.ints.tolist()
        floats: list[float] = self.floats.tolist()
        n, starts = len(rows.rows), self.starts
        out: list[list[dict[int, Logprob]]] = [[] for _ in range(self.num_chunks)]
        row = 0
        for index, count, _ in rows.chunks:
            for r in range(row, row + count):
                first, last = n + starts[r], n + starts[r + 1]
                entry = {
                    tok: Logprob(logprob=lp, rank=rank)
                    for rank, (tok, lp) in enumerate(zip(ints[first:last], floats[first:last]), 1)
                }
                entry[rows.targets[r]] = Logprob(logprob=floats[r], rank=ints[r])
                out[index].append(entry)
            row += count
        return out
