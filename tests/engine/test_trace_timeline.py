"""token_timeline and `deepinfer-kit trace`: per token, the step that sampled it and the
step that committed it (one step later under overlap), or that it was discarded."""

from __future__ import annotations

from typing import Any

import pytest

from deepinfer_kit import SamplingParams, build_engine
from deepinfer_kit.cli import main
from deepinfer_kit.engine.trace import StepTrace, TracedChunk, token_timeline


def _trace(step: int, committed: int, *chunks: TracedChunk) -> StepTrace:
    return StepTrace(step, chunks, 0, 0, 0, 0, 0, 0, 0, (), (), None, 0.0, 0.0, 0.0, committed)


def _chunk(rid: str, position: int, sampled: tuple[int, ...], drafted: int = 0) -> TracedChunk:
    return TracedChunk(rid, "decode", 0, 1, 0, sampled, 1, drafted, 0, output_position=position)


def test_a_preempted_sample_is_discarded_and_its_recompute_committed() -> None:
    traces = [
        _trace(4, 5, _chunk("a", 2, (7,)), _chunk("b", 0, (1,))),
        _trace(5, 6, _chunk("a", 3, (8,))),  # a was preempted before step 5 committed
        _trace(8, 9, _chunk("a", 3, (8,))),  # recomputed, sampled again
        _trace(9, 10, _chunk("a", 4, (5, 6, 9), drafted=2)),  # two drafts accepted
        _trace(10, 11, _chunk("a", 7, (4,))),  # finished at index 6: discarded
    ]
    assert token_timeline(traces, "a", [0, 0, 7, 8, 5, 6, 9]) == [
        (2, 7, 4, 5), (3, 8, 5, None), (3, 8, 8, 9), (4, 5, 9, 10), (5, 6, 9, 10),
        (6, 9, 9, 10), (7, 4, 10, None),
    ]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_token_sampled_past_a_stop_is_discarded_under_overlap(overlap: bool) -> None:
    traces: list[Any] = []
    engine = build_engine(overlap=overlap, num_blocks=32, block_size=8, max_model_len=64, trace=traces.append)
    stop_all = SamplingParams(temperature=1.0, seed=3, max_tokens=10, stop_token_ids=list(range(259)))
    engine.add_request("s", [1, 2, 3], stop_all)
    (out,) = engine.run()
    tokens = out.outputs[0].token_ids
    assert len(tokens) == 1
    timeline = token_timeline(traces, "s", tokens)
    first = (0, tokens[0], 0, 1 if overlap else 0)
    assert timeline == ([first, (1, timeline[-1][1], 1, None)] if overlap else [first])


def test_cli_trace_lists_each_token_with_its_sampled_and_committed_step(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["trace", "--prompt", "abc", "--max-tokens", "3"]
    assert main([*args, "--overlap"]) == 0
    over = capsys.readouterr().out
    assert main([*args, "--no-overlap"]) == 0
    sync = capsys.readouterr().out
    for i in range(3):
        assert f"sampled in step {i}, committed in step {i + 1}" in over, over
        assert f"sampled in step {i}, committed in step {i}" in sync, sync
