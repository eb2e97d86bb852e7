"""The asynchronous (lagged) drafting phase: the planner sees each sequence's confidences
from its previous drafting round, zeros on its first, and its own lengths stay capped by
this round's drafts; of the previous round only what read no position drafted again."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from deepinfer_kit.spec.speculation import Speculation
from deepinfer_kit.request import Request
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.spec.records import DraftProposal

GAMMA = 3


@attrs.define
class _Drafter:
    """Round ``k``'s confidence of request ``r``, position ``j``: ``(k + 1) / 10 + r / 100 + j / 1000``;
    request ``b`` drafts only 1 token."""

    round: int = 0
    proposed: list[list[list[float]]] = attrs.field(factory=list)

    def propose(self, requests: Sequence[Request], num_draft: int) -> DraftProposal:
        conf = [[(self.round + 1) / 10 + r / 100 + j / 1000 for j in range(num_draft)]
                for r in range(len(requests))]
        self.round += 1
        self.proposed.append(conf)
        counts = [1 if q.request_id == "b" else num_draft for q in requests]
        return DraftProposal(torch.ones(len(requests), num_draft, dtype=torch.int64), counts,
                             confidence=torch.tensor(conf))


@attrs.define
class _Planner:
    seen: list[list[list[float]]] = attrs.field(factory=list)

    def plan(self, confidence: Sequence[Sequence[float]], max_lengths: Sequence[int],
             other_tokens: int = 0) -> list[int]:
        self.seen.append([[round(c, 6) for c in row] for row in confidence])
        return list(max_lengths)


def _decoding(rid: str) -> Request:
    req = Request(rid, [1, 2, 3], SamplingParams(max_tokens=8))
    req.block_table = [0]
    req.num_computed_tokens = len(req.all_token_ids) - 1
    return req


def _advance(*requests: Request, tokens: int = GAMMA) -> None:
    """Each of ``requests`` emitted ``tokens`` tokens (the round before accepted them)."""
    for req in requests:
        for _ in range(tokens):
            req.append_token(7)
            req.num_computed_tokens += 1


def test_lagged_planner_sees_the_previous_rounds_confidences() -> None:
    drafter, planner = _Drafter(), _Planner()
    spec = Speculation(drafter, planner, GAMMA, lagged=True)
    a, b, c = _decoding("a"), _decoding("b"), _decoding("c")
    chosen = spec.choose([a, b], 0)
    assert planner.seen[0] == [[0.0] * GAMMA] * 2  # nothing known yet
    assert chosen == [[1] * GAMMA, [1]]  # capped by this round's drafts
    _advance(a, b)
    spec.choose([b, c, a], 0)  # a new sequence, a new order
    first = [[round(x, 6) for x in row] for row in drafter.proposed[0]]
    assert planner.seen[1] == [first[1], [0.0] * GAMMA, first[0]]
    _advance(a, b, c)
    spec.choose([a], 0)  # b and c are gone: their confidences are dropped
    second = [[round(x, 6) for x in row] for row in drafter.proposed[1]]
    assert planner.seen[2] == [second[2]]
    _advance(a, b)
    spec.choose([b], 0)  # b left for a round: what it had is forgotten, not stale
    assert planner.seen[3] == [[0.0] * GAMMA]
    _advance(b, tokens=1)  # one token: c'_0 and c'_1 read positions before b's next draft
    spec.choose([b], 0)
    third = [round(x, 6) for x in drafter.proposed[3][0]]
    assert planner.seen[4] == [[third[0], third[1], third[1]]]


def test_synchronous_planner_sees_this_rounds_confidences() -> None:
    drafter, planner = _Drafter(), _Planner()
    spec = Speculation(drafter, planner, GAMMA)
    live = [_decoding("a")]
    spec.choose(live, 0)
    spec.choose(live, 0)
    assert planner.seen == [[[round(x, 6) for x in row] for row in p] for p in drafter.proposed]
