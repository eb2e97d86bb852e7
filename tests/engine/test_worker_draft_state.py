"""A model drafter in a synchronous worker process (``worker="process"``, ``overlap=False``)
keeps no draft state of finished sequences: after many requests the engine's idle check,
which reaches the worker's drafter, finds no sequence and no draft block held, and the
last requests still draft (a draft pool filled by finished sequences would draft nothing)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deepinfer_kit import SamplingParams, build_engine
from deepinfer_kit.engine.trace import StepTrace
from differential import run_workload

CORPUS = Path(__file__).resolve().parents[2] / "scripts" / "embedded_corpus.txt"
# A draft pool (the target's size) that the draft KV of all requests together overflows
# several times over, a batch of a few at a time.
POOL = {"num_blocks": 48, "block_size": 8, "max_model_len": 96, "max_num_seqs": 4,
        "max_num_batched_tokens": 96}
DRAFTERS: dict[str, dict[str, Any]] = {
    "self": {"model": "tiny", "speculative": {"drafter": "self", "draft_layers": 1, "num_draft": 3}},
    "draft_model": {"model": "tiny",
                    "speculative": {"drafter": "draft_model", "draft_model": "tiny", "num_draft": 3}},
    "dspark": {"model": "tiny-words",
               "speculative": {"drafter": "dspark", "dspark_heads": "tiny-words", "num_draft": 3}},
}


def _requests(num: int) -> list[tuple[str, list[int], SamplingParams]]:
    """``num`` greedy requests of 40 prompt tokens (the embedded corpus: the words model
    drafts well on it) and 12 outputs: 7 blocks of draft KV each."""
    data = CORPUS.read_bytes()
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return [(f"q{i}", list(data[53 * i: 53 * i + 40]), greedy) for i in range(num)]


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_the_synchronous_worker_releases_draft_state_of_finished_sequences(drafter: str) -> None:
    traces: list[StepTrace] = []
    engine = build_engine(worker="process", overlap=False, **DRAFTERS[drafter], **POOL, trace=traces.append)
    assert engine.executor.depth == 0 and type(engine.runner).__name__ == "ProcessRunner"
    reqs = _requests(24)  # 24 x 7 blocks: 3.5 times the 48-block draft pool
    run_workload(reqs, engine=engine)  # ends with engine.check_idle(): the worker's drafter too
    last = {rid for rid, _, _ in reqs[-4:]}
    drafted = sum(c.num_drafted for t in traces for c in t.chunks if c.request_id in last)
    assert drafted > 0, "the last requests drafted nothing: the draft pool is full"
    engine.close()
