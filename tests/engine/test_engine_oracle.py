"""End to end: the Engine's greedy tokens equal transformers' greedy decoding, whatever the
batching, chunking, prefix caching, preemption or component swap.

The oracle recomputes the whole sequence with the transformers model at every step (no KV
cache): for the MoE family, transformers' own cached ``generate`` path drifts from its
full forward on a few prompts (near-tie routing), so it is not a trustworthy reference.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from deepinfer_kit import SamplingParams, build_engine

from hf_models import hf_logits

NEW_TOKENS = 12


def _prompts(seed: int, vocab: int = 160) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(20)]
    prompts = [shared + [rng.randrange(vocab) for _ in range(rng.randint(1, 30))] for _ in range(4)]
    prompts += [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(4)]
    prompts.append(shared[:16])  # exactly a shared full-block prefix: a full-prompt hit
    return prompts


def _full_greedy(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    seq = list(prompt)
    for _ in range(new_tokens):
        seq.append(int(hf_logits(model, seq)[-1].argmax()))
    return seq[len(prompt) :]


_ORACLE: dict[tuple[int, tuple[int, ...]], list[int]] = {}


def _expected(model: Any, prompt: list[int]) -> list[int]:
    key = (id(model), tuple(prompt))
    if key not in _ORACLE:
        _ORACLE[key] = _full_greedy(model, prompt, NEW_TOKENS)
    return _ORACLE[key]


def _run(folder: Path, prompts: list[list[int]], **config: Any) -> list[list[int]]:
    engine = build_engine(model=str(folder), **config)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ids = [engine.add_request(None, p, params) for p in prompts]
    outs = {o.request_id: o for o in engine.run()}
    engine.check_idle()
    return [outs[i].outputs[0].token_ids for i in ids]


CONFIGS = {
    "default": {},
    "chunked-prefill": {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 8},
    "preemption": {"num_blocks": 24, "block_size": 4, "max_model_len": 96},
    "no-prefix-cache": {"enable_prefix_caching": False, "block_size": 4},
    "hash-index": {"prefix_index": "hash", "block_size": 4},
    "static-batching": {"scheduler": "static", "max_num_seqs": 3},
    "priority-policy": {"scheduler_policy": "priority", "max_num_seqs": 2},
}


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_tokens_equal_transformers(
    checkpoints: dict[str, tuple[Path, Any]], family: str, name: str
) -> None:
    folder, hf_model = checkpoints[family]
    prompts = _prompts(seed=7)
    expected = [_expected(hf_model, p) for p in prompts]
    got = _run(folder, prompts, **CONFIGS[name])
    mismatched = [i for i, (a, b) in enumerate(zip(got, expected)) if a != b]
    assert not mismatched, f"{name}: prompts {mismatched} differ from transformers"


def test_prefix_hits_and_preemption_really_happen(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    from deepinfer_kit.engine.trace import StepTrace

    folder, _ = checkpoints["qwen3_moe"]
    traces: list[StepTrace] = []
    engine = build_engine(model=str(folder), num_blocks=24, block_size=4, max_model_len=96, trace=traces.append)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for p in _prompts(seed=3):
        engine.add_request(None, p, params)
    engine.run()
    engine.check_idle()
    assert any(t.preempted for t in traces), "the small pool should force a preemption"
    assert sum(t.prefix_hit_tokens for t in traces) > 0, "shared prompts should hit the prefix cache"
    assert all(t.num_batched_tokens <= t.token_budget for t in traces)
    assert any(t.expert_counts for t in traces), "an MoE model reports expert loads"


@pytest.mark.triton
def test_triton_kernels_give_the_same_greedy_tokens(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    """Every kernel swapped for its Triton implementation (the interpreter on CPU)."""
    folder, hf_model = checkpoints["qwen3_moe"]
    prompts = _prompts(seed=7)[:3]
    expected = [_expected(hf_model, p)[:4] for p in prompts]
    engine = build_engine(
        model=str(folder), attention_impl="triton", moe_impl="triton", sampler_impl="triton", block_size=8
    )
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    ids = [engine.add_request(None, p, params) for p in prompts]
    outs = {o.request_id: o for o in engine.run()}
    engine.check_idle()
    assert [outs[i].outputs[0].token_ids for i in ids] == expected
