"""Prompt logprobs: the extra logits rows a prefill chunk of a request with
``prompt_logprobs`` asks the forward for, and their logprob maps after it."""

from __future__ import annotations

import attrs
import torch

from deepinfer_kit._staging import to_device
from deepinfer_kit.engine.runner.step_outputs import asked_top
from deepinfer_kit.outputs import Logprob
from deepinfer_kit.sched.records import ScheduledChunk

__all__ = ["PromptRows"]


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
    ) -> tuple[torch.Tensor, list[list[dict[int, Logprob]]] | None]:
        """``(sampling rows' logits, prompt logprob maps per chunk or None)`` of the
        forward's ``[num_sampled + len(rows), V]`` logits (called by ``execute``)."""
        if not self.rows:
            return logits, None
        return logits[:num_sampled], self.maps(logits[num_sampled:], num_chunks)

    def maps(self, logits: torch.Tensor, num_chunks: int) -> list[list[dict[int, Logprob]]]:
        """Per plan chunk, the logprob map of each of its rows: the target's logprob and
        rank under the raw logits plus the top ``prompt_logprobs`` alternatives.

        Args:
            logits: ``[len(rows), V]`` raw logits of the rows (any device); not mutated.
            num_chunks: chunks of the plan (chunks without rows get ``[]``).

        Two copies back to the host (ints, floats), each row's asked top only (see
        :func:`~deepinfer_kit.engine.runner.step_outputs.asked_top`). A row whose logits are all
        ``-inf`` reports ``-inf``, never NaN.
        """
        x = logits.to(torch.float32)
        lse = torch.logsumexp(x, dim=-1, keepdim=True)
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        target = to_device(self.targets, torch.int64, x.device)
        chosen = x.gather(1, target[:, None])
        ranks = (x > chosen).sum(dim=-1) + 1
        top = min(max(k for _, _, k in self.chunks), x.shape[1])
        values, ids = torch.topk(x, top, dim=-1, sorted=True)
        wants = [want for _, count, want in self.chunks for _ in range(count)]
        flat_ids, flat_lp, starts = asked_top(ids, values - lse, wants)
        ints: list[int] = torch.cat([ranks, flat_ids]).tolist()
        floats: list[float] = torch.cat([(chosen - lse)[:, 0], flat_lp]).tolist()
        n = len(self.rows)
        out: list[list[dict[int, Logprob]]] = [[] for _ in range(num_chunks)]
        row = 0
        for index, count, _ in self.chunks:
            for r in range(row, row + count):
                first, last = n + starts[r], n + starts[r + 1]
                entry = {
                    tok: Logprob(logprob=lp, rank=rank)
                    for rank, (tok, lp) in enumerate(zip(ints[first:last], floats[first:last]), 1)
                }
                entry[self.targets[r]] = Logprob(logprob=floats[r], rank=ints[r])
                out[index].append(entry)
            row += count
        return out
