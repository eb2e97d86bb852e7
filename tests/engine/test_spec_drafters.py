"""The model drafters in the engine: a draft checkpoint and self-speculation (the target's
first layers), each over KV blocks of its own.

Greedy speculative output equals plain greedy on every prompt for both drafters on a dense
and an MoE family; an identical draft model is accepted in full; sampled runs complete;
the draft pool gives every block back after each round's rollback, on finish, abort and
preemption.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest

from deepinfer_kit import SamplingParams, build_engine
from deepinfer_kit.spec.drafters.draft_model import DraftModelDrafter
from deepinfer_kit.engine.engine import Engine
from deepinfer_kit.engine.trace import StepTrace
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.spec.records import SpecConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from hf_models import make_checkpoint  # noqa: E402

from draft_pool import check_draft_pool  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory,
           checkpoints: dict[str, tuple[Path, Any]]) -> dict[str, str]:
    """Target checkpoints of a dense family (llama, untied: its greedy text does not
    just repeat the last token, as the tied test qwen3 does) and an MoE family
    (qwen3_moe), plus ``draft``: another llama (other weights, same vocabulary), a weak
    draft model for both."""
    root = tmp_path_factory.mktemp("drafters")
    make_checkpoint("llama", root / "dense", seed=1)
    make_checkpoint("llama", root / "draft", seed=7)
    return {"dense": str(root / "dense"), "moe": str(checkpoints["qwen3_moe"][0]),
            "draft": str(root / "draft")}


def _prompts(seed: int, vocab: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        if i % 2:
            out.append([rng.randrange(vocab) for _ in range(rng.randint(3, 25))])
        else:
            unit = [rng.randrange(vocab) for _ in range(rng.randint(2, 5))]
            out.append((unit * 10)[: rng.randint(6, 30)])
    return out


def _drafter(engine: Engine) -> DraftModelDrafter:
    assert engine.runner.drafting is not None
    drafter = engine.runner.drafting.speculation.drafter
    assert isinstance(drafter, DraftModelDrafter)
    return drafter


def _check_draft_kv(engine: Engine) -> int:
    """After a committed round: see :func:`draft_pool.check_draft_pool`."""
    return check_draft_pool(_drafter(engine).book, engine)


def _run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams],
         traces: list[StepTrace] | None = None, check_each_round: bool = False) -> dict[str, Any]:
    if traces is not None:
        engine.subscribe(traces.append)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = [c.token_ids for c in o.outputs]
        if check_each_round:
            _check_draft_kv(engine)
    for o in engine.flush():
        outs[o.request_id] = [c.token_ids for c in o.outputs]
    engine.check_idle()
    return outs


def _compare(model: str, spec: dict[str, Any], prompts: list[list[int]],
             params: list[SamplingParams], **config: Any) -> list[StepTrace]:
    want = _run(build_engine(model=model, **config), prompts, params)
    traces: list[StepTrace] = []
    fast = build_engine(model=model, speculative=spec, **config)
    got = _run(fast, prompts, params, traces, check_each_round=True)
    assert got == want
    drafter = _drafter(fast)
    drafter.check_idle()
    assert drafter.book.allocator.num_free == drafter.book.allocator.num_blocks
    assert sum(t.num_drafted for t in traces) > 0
    return traces


def _greedy(n: int, max_tokens: int = 16) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                           repetition_penalty=1.2 if i % 4 == 3 else 1.0) for i in range(n)]


CONFIG: dict[str, Any] = dict(num_blocks=128, block_size=4, max_model_len=128)


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_self_speculation_greedy_equals_plain(family: str, models: dict[str, str]) -> None:
    prompts = _prompts(11, 160, 8)
    traces = _compare(models[family], {"drafter": "self", "draft_layers": 1, "num_draft": 3},
                      prompts, _greedy(len(prompts)), **CONFIG)
    drafted = sum(t.num_drafted for t in traces)
    assert drafted > sum(t.num_accepted for t in traces)  # some drafts were rolled back


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_draft_model_greedy_equals_plain(family: str, models: dict[str, str]) -> None:
    """A dense draft with other weights for a dense and for an MoE target: drafts mostly
    rejected, output still plain greedy's."""
    prompts = _prompts(12, 160, 8)
    _compare(models[family], {"drafter": "draft_model", "draft_model": models["draft"],
                              "num_draft": 4}, prompts, _greedy(len(prompts)), **CONFIG)


@pytest.mark.parametrize("model", ["dense", "tiny"])
def test_an_identical_draft_model_is_accepted_in_full(model: str, models: dict[str, str]) -> None:
    """The oracle: a draft with the target's own weights drafts the target's greedy
    tokens, so under greedy every draft is accepted and each round emits γ + 1 tokens
    (the MoE tiny model and a dense checkpoint)."""
    path = models[model] if model == "dense" else "tiny"
    gamma = 3
    prompts = _prompts(13, 160, 4)
    traces = _compare(path, {"drafter": "draft_model", "draft_model": path, "num_draft": gamma},
                      prompts, _greedy(len(prompts), max_tokens=17), **CONFIG)
    verify = [c for t in traces for c in t.chunks if c.num_drafted]
    assert verify and all(c.num_accepted == c.num_drafted for c in verify)
    assert sum(c.num_drafted == gamma for c in verify) >= len(verify) - len(prompts)


def test_chunked_prefill_preemption_stops_and_the_draft_pool() -> None:
    """A small target pool forces preemption; the draft releases a preempted sequence's
    blocks and catches up its whole history when it resumes; stop tokens end requests
    inside accepted runs."""
    rng = random.Random(5)
    prompts = _prompts(14, 256, 10)
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(5, 24), ignore_eos=True,
                             stop_token_ids=(7, 9) if i % 2 else ()) for i in range(len(prompts))]
    for spec in ({"drafter": "self", "draft_layers": 1, "num_draft": 4},
                 {"drafter": "draft_model", "draft_model": "tiny", "num_draft": 4}):
        traces = _compare("tiny", spec, prompts, params, num_blocks=20, block_size=4,
                          max_model_len=80, max_num_batched_tokens=24)
        assert any(t.preempted for t in traces), "the small pool must force preemption"


@pytest.mark.parametrize("drafter", ["self", "draft_model"])
def test_sampling_with_seeds_completes_is_reproducible_and_uses_draft_probs(drafter: str) -> None:
    """Seeded sampled requests (forks, penalties, top-k/top-p) run to their lengths; the
    verifier receives the draft distributions; two runs give the same tokens; the pools
    are idle afterwards."""
    spec: dict[str, Any] = {"drafter": drafter, "num_draft": 3}
    spec |= {"draft_layers": 1} if drafter == "self" else {"draft_model": "tiny"}
    prompts = _prompts(15, 256, 6)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=12, n=2 if i % 3 == 1 else 1,
                             top_k=20 if i % 2 else -1, top_p=0.9, frequency_penalty=0.2,
                             ignore_eos=True) for i in range(len(prompts))]
    runs = []
    for _ in range(2):
        engine = build_engine(speculative=spec, **CONFIG)
        seen: list[Any] = []
        verifier = engine.runner.verifier
        assert verifier is not None
        inner = verifier.verify
        engine.runner.verifier.verify = lambda rows, probs=None: (seen.append(probs), inner(rows, probs))[1]  # type: ignore[method-assign]
        runs.append(_run(engine, prompts, params, check_each_round=False))
        assert seen and all(s is not None for s in seen)
    assert runs[0] == runs[1]
    for i, sp in enumerate(params):
        assert [len(c) for c in runs[0][f"r{i}"]] == [12] * sp.n


def test_aborts_release_the_draft_blocks() -> None:
    prompts = _prompts(16, 256, 8)
    engine = build_engine(speculative={"drafter": "self", "draft_layers": 1, "num_draft": 3},
                          **CONFIG)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=30,
                                                      ignore_eos=True))
    step = 0
    reasons = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            reasons[o.request_id] = o.outputs[0].finish_reason
        step += 1
        if step in (2, 3, 4):  # abort mid-decode, with draft KV held
            assert _check_draft_kv(engine) > 0
            engine.abort(f"r{step}")
            engine.abort(f"r{step + 3}")
        _check_draft_kv(engine)
    engine.flush()
    engine.check_idle()
    assert sum(r == "abort" for r in reasons.values()) == 6


def test_the_idle_check_sees_a_leaked_draft_block() -> None:
    engine = build_engine(speculative={"drafter": "self", "draft_layers": 1}, **CONFIG)
    engine.add_request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4, temperature=0.0))
    engine.run()
    engine.check_idle()
    _drafter(engine).book.reserve("ghost", 5)
    with pytest.raises(Exception, match="draft KV not idle"):
        engine.check_idle()


def test_drafter_config_errors(models: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="speculative.draft_model must name"):
        SpecConfig(drafter="draft_model")
    with pytest.raises(ConfigError, match=r"speculative.draft_layers must be an int >= 1.*got 0"):
        SpecConfig(drafter="self", draft_layers=0)
    with pytest.raises(ConfigError, match="draft_layers is read only by drafter='self'"):
        build_engine(speculative={"drafter": "ngram", "draft_layers": 2})
    with pytest.raises(ConfigError, match=r"draft_layers must be an int in \[1, 2\].*got 3"):
        build_engine(speculative={"drafter": "self", "draft_layers": 3}, **CONFIG)
    with pytest.raises(ConfigError, match="vocab_size 259, the target has 160"):
        build_engine(model=models["dense"], num_blocks=64, max_model_len=128,
                     speculative={"drafter": "draft_model", "draft_model": "tiny"})


def test_threshold_planner_stops_drafting_early_without_changing_what_is_verified() -> None:
    """With the threshold planner the drafter stops a request once its survival falls
    below the threshold: the same drafts are verified as when it drafts all γ and the
    planner cuts them, with fewer draft forwards."""
    spec = {"drafter": "self", "draft_layers": 1, "num_draft": 5, "planner": "threshold",
            "threshold": 0.05}
    prompts = _prompts(17, 256, 4)
    params = _greedy(len(prompts), max_tokens=20)
    runs = []
    for stop in (True, False):
        engine = build_engine(speculative=spec, **CONFIG)
        if not stop:
            _drafter(engine).stop_below = 0.0
        traces: list[StepTrace] = []
        outs = _run(engine, prompts, params, traces)
        verified = [(c.request_id, c.num_drafted, c.num_accepted) for t in traces for c in t.chunks]
        runs.append((outs, verified, _drafter(engine).num_forwards))
    (outs_a, ver_a, fwd_a), (outs_b, ver_b, fwd_b) = runs
    assert outs_a == outs_b and ver_a == ver_b
    assert any(n for _, n, _ in ver_a) and any(0 < n < 5 for _, n, _ in ver_a)
    assert fwd_a < fwd_b
