"""Under overlap the next round is planned before the last one commits, so a prompt's next
chunk moves its windows past blocks not published yet. Their windows are kept idle (not
freed): a later prompt sharing a prefix that ends inside an earlier chunk finds the window
it needs, as without overlap (a 5 local : 1 global Qwen2, window 3, blocks of 4)."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest

from deepinfer_kit import SamplingParams, build_engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

from hf_models import five_to_one  # noqa: E402

_RNG = random.Random(3)
_SHARED = [_RNG.randrange(160) for _ in range(20)]  # ends inside the first prompt's second chunk
_PROMPTS = [_SHARED + [_RNG.randrange(160) for _ in range(28)], _SHARED + [_RNG.randrange(160) for _ in range(9)]]


@pytest.fixture(scope="module")
def narrow(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen2_5to1_w3_overlap")
    five_to_one(folder, 3, 5)
    return folder


def _serve(folder: Path, overlap: bool, **extra: Any) -> tuple[list[list[int]], int, int]:
    """Tokens, tokens kept from prefix hits, prefill tokens computed."""
    engine = build_engine(model=str(folder), block_size=4, attention_impl="ref", max_num_seqs=2, num_blocks=64,
                          max_num_batched_tokens=16, max_model_len=96, overlap=overlap, **extra)
    computed = 0

    def count(trace: Any) -> None:
        nonlocal computed
        computed += sum(c.num_tokens for c in trace.chunks if c.kind == "prefill")

    engine.subscribe(count)
    out = []
    for p in _PROMPTS:  # one after the other: the second hits the first's published prefix
        engine.add_request(None, p, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        out += [list(o.outputs[0].token_ids) for o in engine.run()]
    kept = engine.cache.window_stats.kept_tokens  # type: ignore[attr-defined]
    engine.check_idle()
    engine.close()
    return out, kept, computed


@pytest.mark.parametrize("extra", [{}, {"kv_tiers": {"host_blocks": 32}}], ids=["device", "tiers"])
def test_overlap_keeps_the_windows_of_blocks_published_a_round_late(narrow: Path, extra: dict[str, Any]) -> None:
    sync = _serve(narrow, False, **extra)
    overlapped = _serve(narrow, True, **extra)
    assert sync[1] == 20  # the whole shared prefix, its window cached
    assert overlapped == sync
