"""The DSpark drafter in the engine, with the heads shipped for tiny-words.

Greedy speculative output equals plain greedy on every prompt; the backbone's own pool
holds exactly each running sequence's tokens after every round and is empty at the end
(finish, preemption); the calibrated confidences match the acceptance measured on
held-out prompts; sampled runs hand the draft distributions to rejection sampling.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer_kit import SamplingParams, build_engine
from deepinfer_kit.spec.drafters.dspark import DSparkDrafter
from deepinfer_kit.engine.engine import Engine
from deepinfer_kit.errors import CheckpointError, ConfigError
from deepinfer_kit.request import Request
from deepinfer_kit.spec.records import DraftProposal

sys.path.insert(0, str(Path(__file__).resolve().parent))
from draft_pool import check_draft_pool  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_dspark.py"
SPEC: dict[str, Any] = {"drafter": "dspark", "dspark_heads": "tiny-words", "num_draft": 4}
CONFIG: dict[str, Any] = dict(model="tiny-words", num_blocks=160, block_size=8, max_model_len=160)


def _prompts(seed: int, count: int) -> list[list[int]]:
    """The training script's kind of prompt (corpus windows and random bytes, 4..40 long),
    from other seeds than its training and calibration data's."""
    return _training_script().prompts(count, random.Random(seed))


def _training_script() -> Any:
    if "train_dspark" not in sys.modules:
        spec = importlib.util.spec_from_file_location("train_dspark", SCRIPT)
        assert spec is not None and spec.loader is not None
        sys.modules["train_dspark"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["train_dspark"]


def _drafter(engine: Engine) -> DSparkDrafter:
    assert engine.runner.drafting is not None
    drafter = engine.runner.drafting.speculation.drafter
    assert isinstance(drafter, DSparkDrafter)
    return drafter


def _check_pool(engine: Engine) -> None:
    check_draft_pool(_drafter(engine).book, engine)


def _run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams],
         check: bool = False) -> dict[str, list[list[int]]]:
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    outs: dict[str, list[list[int]]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = [list(c.token_ids) for c in o.outputs]
        if check and engine.runner.drafting is not None:
            _check_pool(engine)
    engine.check_idle()
    return outs


def _greedy(n: int, max_tokens: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                           repetition_penalty=1.3 if i % 5 == 4 else 1.0) for i in range(n)]


def test_greedy_equals_plain_on_every_prompt_and_the_pool_is_returned() -> None:
    prompts = _prompts(101, 14)
    params = _greedy(len(prompts), 28)
    want = _run(build_engine(**CONFIG), prompts, params)
    engine = build_engine(speculative=SPEC, **CONFIG)
    drafted = [0]
    inner = _drafter(engine).propose
    _drafter(engine).propose = lambda r, g: (p := inner(r, g), drafted.append(sum(p.num_drafted)))[0]  # type: ignore[method-assign]
    got = _run(engine, prompts, params, check=True)
    assert got == want
    assert sum(drafted) > 0
    book = _drafter(engine).book
    assert len(book) == 0 and book.allocator.num_free == book.allocator.num_blocks


def test_preemption_and_stops_keep_greedy_and_return_every_block() -> None:
    prompts = _prompts(102, 10)
    params = [SamplingParams(temperature=0.0, max_tokens=20 + i, ignore_eos=True,
                             stop_token_ids=(ord("e"),) if i % 2 else ()) for i in range(10)]
    small = {**CONFIG, "num_blocks": 24, "block_size": 4, "max_model_len": 80,
             "max_num_batched_tokens": 32}
    want = _run(build_engine(**small), prompts, params)
    assert _run(build_engine(speculative=SPEC, **small), prompts, params, check=True) == want


def test_calibrated_confidence_matches_acceptance_on_held_out_prompts() -> None:
    """Per position k, the mean calibrated survival Π_{i<=k} c_i of the drafted blocks is
    within 0.08 of the fraction of blocks whose first k drafts the target accepted (greedy,
    judged against the final output, which is plain greedy's), on prompts of the kind the
    heads were calibrated on (other seeds), continued to 128 tokens as there."""
    prompts = _prompts(103, 24)
    engine = build_engine(speculative=SPEC, **{**CONFIG, "num_blocks": 400})
    blocks: list[tuple[str, int, list[int], torch.Tensor]] = []
    inner = _drafter(engine).propose

    def record(reqs: list[Request], gamma: int) -> DraftProposal:
        p = inner(reqs, gamma)
        assert p.confidence is not None
        for i, r in enumerate(reqs):
            if p.num_drafted[i] == gamma:
                blocks.append((r.request_id, len(r.all_token_ids), p.token_ids[i].tolist(),
                               p.confidence[i]))
        return p

    _drafter(engine).propose = record  # type: ignore[method-assign]
    # the calibration workload's shape: greedy continuations to 128 tokens
    params = [SamplingParams(temperature=0.0, max_tokens=128 - len(p), ignore_eos=True)
              for p in prompts]
    outs = _run(engine, prompts, params)
    full = {f"r{i}": p + outs[f"r{i}"][0] for i, p in enumerate(prompts)}
    predicted, accepted = [], []
    for rid, n, drafts, conf in blocks:
        seq = full[rid]
        if n + 4 > len(seq):
            continue
        ok = torch.cumprod(torch.tensor([d == t for d, t in zip(drafts, seq[n:n + 4])],
                                        dtype=torch.float64), 0)
        accepted.append(ok)
        predicted.append(torch.cumprod(conf.double(), 0))
    assert len(accepted) >= 200
    emp, pred = torch.stack(accepted).mean(0), torch.stack(predicted).mean(0)
    assert (emp - pred).abs().max() <= 0.08, (emp.tolist(), pred.tolist())
    assert emp[0] >= 0.5  # the heads learned something: most first drafts are accepted


def test_sampling_hands_draft_probs_to_the_verifier_and_is_reproducible() -> None:
    prompts = _prompts(104, 5)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=14, n=2 if i == 1 else 1,
                             top_k=30 if i % 2 else -1, top_p=0.9, ignore_eos=True)
              for i in range(len(prompts))]
    runs = []
    for _ in range(2):
        engine = build_engine(speculative=SPEC, **CONFIG)
        seen: list[Any] = []
        verifier = engine.runner.verifier
        assert verifier is not None
        inner = verifier.verify
        verifier.verify = lambda rows, probs=None: (seen.append(probs), inner(rows, probs))[1]  # type: ignore[method-assign]
        runs.append(_run(engine, prompts, params, check=True))
        assert seen and all(s is not None for s in seen)
    assert runs[0] == runs[1]
    assert all(len(c) == 14 for out in runs[0].values() for c in out)


def test_build_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"num_draft must be <= 4 .*got 5"):
        build_engine(speculative={**SPEC, "num_draft": 5}, **CONFIG)
    with pytest.raises(CheckpointError, match="no such file"):
        build_engine(speculative={**SPEC, "dspark_heads": str(tmp_path / "x.safetensors")},
                     **CONFIG)
    with pytest.raises(CheckpointError, match=r"tensor 'parallel.weight' has shape \[4, 128, 128\]"):
        build_engine(speculative=SPEC, model="tiny")  # the random tiny: hidden size 64
