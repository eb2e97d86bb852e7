"""The runner's GrammarStage alone, on a fake backend (no xgrammar needed): each row masked
by its own sequence's matcher moved to the row's history (rollback to the common prefix,
replay past ``max_rollback``), rows the grammar leaves empty reported, and on CUDA the
bitmask goes to the device without the host waiting (cuda tier)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepinfer_kit import SamplingParams
from deepinfer_kit.engine.runner.grammar_stage import GrammarStage
from deepinfer_kit.sample.structured.bitmask import bitmask_row

V = 64


class _Matcher:
    """Allows token ``(sum(history) + k) % V`` for k in 0..3; refuses token 63 always."""

    def __init__(self, log: list[str]) -> None:
        self.history: list[int] = []
        self.log = log
        self.max_rollback = 2

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = bitmask_row(((sum(self.history) + k) % V for k in range(4)), V)

    def accept_token(self, token: int) -> bool:
        if token == 63:
            return False
        self.history.append(token)
        self.log.append(f"accept {token}")
        return True

    def rollback(self, n: int) -> None:
        self.log.append(f"rollback {n}")
        del self.history[len(self.history) - n:]

    def reset(self) -> None:
        self.log.append("reset")
        self.history.clear()


class _Backend:
    vocab_size = V

    def __init__(self) -> None:
        self.log: list[str] = []

    def compile(self, spec: Any) -> Any:
        return spec

    def matcher(self, grammar: Any, *, max_rollback: int) -> _Matcher:
        return _Matcher(self.log)


def _allowed(logits: torch.Tensor, row: int) -> set[int]:
    return {t for t in range(V) if logits[row, t] > float("-inf")}


def _stage(device: str = "cpu") -> tuple[GrammarStage, _Backend]:
    backend = _Backend()
    return GrammarStage(lambda: backend, pin_memory=device == "cuda"), backend  # type: ignore[arg-type,return-value]


P = SamplingParams(structured_outputs={"regex": "x"})
FREE = SamplingParams()


def test_each_row_follows_its_history_and_others_are_untouched() -> None:
    stage, _ = _stage()
    logits = torch.zeros(3, V)
    alive = stage.apply(logits, [(0, "a"), (2, "b")], [P, FREE, P], [(1, 2), (9,), (5,)])
    assert _allowed(logits, 0) == {3, 4, 5, 6} and _allowed(logits, 2) == {5, 6, 7, 8}
    assert _allowed(logits, 1) == set(range(V)) and alive.tolist() == [True, True, True]


def test_rollback_to_the_common_prefix_and_replay_past_max_rollback() -> None:
    stage, backend = _stage()
    stage.apply(torch.zeros(1, V), [(0, "a")], [P], [(1, 2, 3, 4)])
    backend.log.clear()
    stage.apply(torch.zeros(1, V), [(0, "a")], [P], [(1, 2, 9)])  # two dropped, one new
    assert backend.log == ["rollback 2", "accept 9"]
    backend.log.clear()
    stage.apply(torch.zeros(1, V), [(0, "a")], [P], [(8, 8, 8, 8)])  # three dropped > 2: replay
    assert backend.log == ["reset"] + ["accept 8"] * 4


def test_verify_rows_of_one_sequence_and_a_refused_draft() -> None:
    stage, _ = _stage()
    logits = torch.zeros(3, V)
    stage.apply(logits, [(0, "a"), (1, "a"), (2, "a")], [P] * 3, [(1,), (1, 2), (1, 2, 63)])
    assert _allowed(logits, 0) == {1, 2, 3, 4} and _allowed(logits, 1) == {3, 4, 5, 6}
    assert _allowed(logits, 2) == set(range(V))  # past a refused draft: never used, left as is


def test_a_sequence_absent_from_a_step_is_replayed() -> None:
    stage, backend = _stage()
    stage.apply(torch.zeros(1, V), [(0, "a")], [P], [(1, 2)])
    stage.apply(torch.zeros(1, V), [(0, "b")], [P], [(3,)])
    backend.log.clear()
    stage.apply(torch.zeros(1, V), [(0, "a")], [P], [(1, 2, 3)])
    assert backend.log == ["accept 1", "accept 2", "accept 3"]


@pytest.mark.cuda
def test_on_cuda_nothing_is_read_back() -> None:
    stage, _ = _stage("cuda")
    logits = torch.zeros(2, V, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        alive = stage.apply(logits, [(1, "a")], [FREE, P], [(), (4,)])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert _allowed(logits.cpu(), 1) == {4, 5, 6, 7} and alive.cpu().tolist() == [True, True]


def test_grammars_are_kept_only_while_a_sequence_uses_them() -> None:
    stage, _ = _stage()
    specs = [SamplingParams(structured_outputs={"regex": f"x{i}"}) for i in range(50)]
    for i, p in enumerate(specs):
        stage.apply(torch.zeros(1, V), [(0, f"s{i}")], [p], [(1,)])
    assert len(stage._compiled) == 1 and len(stage._tracked) == 1  # the last step's only
