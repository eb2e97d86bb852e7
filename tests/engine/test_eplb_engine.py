"""Live EPLB in the engine: outputs unchanged across rebalances, the window equals the
routers' counts, slot weights always copies of their expert, bad configs refused."""

from __future__ import annotations

import random
from pathlib import Path
from collections.abc import Callable
from typing import Any

import pytest
import torch

from deepinfer_kit import ConfigError, Engine, SamplingParams, build_engine
from deepinfer_kit.engine.runner.balance import moe_layers
from deepinfer_kit.engine.trace import StepTrace
from deepinfer_kit.moe.records import Routing
from deepinfer_kit.moe.selector_tables import tables_of

from hf_models import make_checkpoint
from static_rounds import record_static_rounds

NEW_TOKENS = 8
REBALANCING = {"window": 3, "interval": 2, "num_redundant": 4, "num_gpus": 4}


_FOLDERS: dict[str, Path] = {}


@pytest.fixture(scope="module")
def folder_of(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """``model name -> path``: ``"tiny"`` itself, or a checkpoint of that family made on
    first use: softmax routing without shared experts (mixtral), DeepSeek-V3 grouped
    routing with a shared expert and a dense first layer (glm4_moe), dense (qwen3)."""

    def get(model: str) -> str:
        if model == "tiny":
            return model
        if model not in _FOLDERS:
            _FOLDERS[model] = tmp_path_factory.mktemp("eplb_ckpt") / model
            make_checkpoint(model, _FOLDERS[model], seed=3)
        return str(_FOLDERS[model])

    return get


def _prompts(seed: int, vocab: int = 160) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(2, 30))] for _ in range(5)]


def _run(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ids = [engine.add_request(None, p, params) for p in prompts]
    outs = {o.request_id: o for o in engine.run()}
    engine.check_idle()
    return [outs[i].outputs[0].token_ids for i in ids]


@pytest.mark.parametrize(
    ("model", "eplb"),
    [
        ("tiny", REBALANCING),
        ("tiny", REBALANCING | {"policy": "forecast", "num_redundant": 2, "num_gpus": 2}),
        ("mixtral", REBALANCING | {"policy": "peak", "num_redundant": 2, "num_gpus": 2}),
        ("glm4_moe", REBALANCING | {"num_nodes": 2, "num_groups": 2}),
        ("tiny", REBALANCING | {"dispatch": "even"}),
        ("mixtral", REBALANCING | {"policy": "refine", "dispatch": "balanced"}),
    ],
)
def test_greedy_tokens_unchanged_across_rebalances(
    folder_of: Callable[[str], str], model: str, eplb: dict[str, Any]
) -> None:
    prompts = _prompts(7)
    common = {"model": folder_of(model), "block_size": 4, "max_num_batched_tokens": 48}
    want = _run(build_engine(**common), prompts)
    engine = build_engine(**common, eplb=eplb)
    assert _run(engine, prompts) == want
    balancer = engine.balancer
    assert balancer is not None
    assert len(balancer.history) >= 3  # requests were in flight across several swaps
    assert sum(r.moved_slots for r in balancer.history) > 0
    previous = balancer.history[0].phy2log
    for r in balancer.history[1:]:  # a slot is copied exactly when its expert changes
        assert r.moved_slots == int((r.phy2log != previous).sum())
        assert r.balancedness_after >= r.balancedness_before  # no layer takes a worse plan
        previous = r.phy2log


def test_overlapped_engine_rebalances_between_steps() -> None:
    """Under overlap the rounds in flight are committed before the weights move."""
    prompts = _prompts(11)
    want = _run(build_engine(block_size=4, max_num_batched_tokens=40), prompts)
    engine = build_engine(block_size=4, max_num_batched_tokens=40, overlap=True,
                          eplb=REBALANCING | {"policy": "global", "num_redundant": 8, "num_gpus": 8})
    assert _run(engine, prompts) == want
    assert engine.balancer is not None and len(engine.balancer.history) >= 3


def test_slots_hold_copies_of_their_expert_and_tables_agree() -> None:
    reference = moe_layers(build_engine().runner.model)
    engine = build_engine(block_size=4, eplb=REBALANCING | {"policy": "movement"})
    layers = moe_layers(engine.runner.model)
    _run(engine, _prompts(3))
    balancer = engine.balancer
    assert balancer is not None and balancer.history
    for ref, layer, phy2log in zip(reference, layers, balancer.placement.phy2log):
        table = layer.replicas
        assert table is not None
        assert table.phy2log.tolist() == phy2log.tolist() == list(table.slot_experts)
        index = phy2log.clone()
        assert torch.equal(layer.experts.gate_up, ref.experts.gate_up[index])
        assert torch.equal(layer.experts.down, ref.experts.down[index])
        counts = torch.bincount(phy2log, minlength=8)
        assert (counts >= 1).all() and torch.equal(table.logcnt, counts)
        for expert in range(8):
            replicas = table.log2phy[expert, : int(counts[expert])].tolist()
            assert sorted(replicas) == [s for s, e in enumerate(phy2log.tolist()) if e == expert]
        per_gpu = phy2log.view(4, -1)
        for gpu in per_gpu:  # 12 slots, 4 GPUs, 8 experts: no expert twice on one GPU
            assert len(set(gpu.tolist())) == gpu.numel()


def test_window_equals_the_routers_counts() -> None:
    engine = build_engine(block_size=4, max_num_batched_tokens=32,
                          eplb={"window": 5, "interval": 1000, "num_redundant": 4, "num_gpus": 2})
    layers = moe_layers(engine.runner.model)
    seen: list[list[torch.Tensor]] = [[] for _ in layers]

    def hook(i: int) -> Any:
        def record(module: Any, args: Any, out: Routing) -> None:
            seen[i].append(out.expert_counts(8).cpu())
        return record

    for i, layer in enumerate(layers):
        layer.gate.register_forward_hook(hook(i))
    _run(engine, _prompts(5))
    balancer = engine.balancer
    assert balancer is not None
    steps = len(seen[0])
    assert steps > 5 and balancer.window.num_recorded == steps
    want = torch.stack([torch.stack(per_layer[-5:]).sum(0) for per_layer in seen])
    assert torch.equal(balancer.window.total().cpu(), want)


def test_trace_reports_per_slot_counts() -> None:
    traces: list[StepTrace] = []
    engine = build_engine(block_size=4, eplb=REBALANCING | {"interval": 3}, trace=traces.append)
    _run(engine, _prompts(9))
    balancer = engine.balancer
    assert balancer is not None
    assert all(t.slot_counts is not None and t.expert_counts is not None for t in traces if t.chunks)
    spread = 0
    for t in traces:
        if t.slot_counts is None or t.expert_counts is None:
            continue
        for slots, experts in zip(t.slot_counts, t.expert_counts):
            assert len(slots) == 12 and sum(slots) == sum(experts) > 0
        spread += sum(1 for slots in t.slot_counts if sum(1 for c in slots if c) > 8)
    assert spread > 0  # a replicated expert's copies went to more than one of its slots


@pytest.mark.parametrize(
    ("eplb", "message"),
    [
        ({"window": 0}, "eplb.window must be an int >= 1, got 0"),
        ({"interval": "2"}, "eplb.interval must be an int >= 1, got '2'"),
        ({"policy": "lru"}, "eplb.policy must be one of .*, got 'lru'"),
        ({"num_redundant": -1}, "eplb.num_redundant must be an int >= 0, got -1"),
        ({"decay": 1.0}, r"eplb.decay must be a number in \[0, 1\), got 1.0"),
        ({"dispatch": "lp"}, r"eplb.dispatch must be one of \['static', 'even', 'balanced'\], got 'lp'"),
        ({"windows": 4}, r"eplb has unknown keys \['windows'\]"),
        ({"num_redundant": 1, "num_gpus": 2}, "eplb.num_redundant=1 gives .* = 9 slots, not divisible by eplb.num_gpus=2"),
        ({"num_gpus": 2, "num_nodes": 4}, "eplb.num_nodes must divide eplb.num_gpus=2, got 4"),
        ({"num_groups": 3}, "eplb.num_groups must divide the 8 experts, got 3"),
        ("on", "eplb must be an EplbConfig, a dict or None, got 'on'"),
    ],
)
def test_bad_eplb_config_names_the_field(eplb: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_engine(eplb=eplb)


@pytest.mark.parametrize(("overlap", "dispatch"), [(False, "balanced"), (True, "static")],
                         ids=["sync-balanced", "overlap-static"])
def test_padded_static_rounds_rebalance_like_the_unpadded_engine(overlap: bool, dispatch: str) -> None:
    """EPLB on the static decode path (what CUDA graphs replay; eager here): padded rows
    are computed but never enter the window, so the windows, plans, rebalance points
    and tokens are the unpadded engine's, and the slot maps and selector tables a graph
    would read are the same tensors before and after every rebalance."""
    prompts = _prompts(17) + _prompts(18)  # 10 requests: rounds pad to 13 and below
    common = {"block_size": 4, "max_num_batched_tokens": 64, "max_num_seqs": 13, "overlap": overlap,
              "eplb": REBALANCING | {"dispatch": dispatch, "policy": "refine"}}
    plain = build_engine(static_decode=False, **common)
    want = _run(plain, prompts)
    engine = build_engine(static_decode=True, **common)
    rounds = record_static_rounds(engine)
    layers = moe_layers(engine.runner.model)
    live = [(t.layout, {k: v.data_ptr() for k, v in vars(tables_of(t.layout)).items()
                        if isinstance(v, torch.Tensor)}) for t in (layer.replicas for layer in layers) if t]
    assert _run(engine, prompts) == want
    assert any(r.size > r.real for r in rounds), f"no padded round ran: {rounds}"
    here, there = plain.balancer, engine.balancer
    assert here is not None and there is not None and len(here.history) >= 3
    assert [r.after_step for r in there.history] == [r.after_step for r in here.history]
    for a, b in zip(here.history, there.history):
        assert torch.equal(a.window, b.window) and torch.equal(a.phy2log, b.phy2log)
    assert any(r.moved_slots for r in there.history)
    for (layout, ptrs), layer in zip(live, layers):
        assert layer.replicas is not None and layer.replicas.layout is layout
        tables = tables_of(layout)
        assert {k: v.data_ptr() for k, v in vars(tables).items() if isinstance(v, torch.Tensor)} == ptrs
        assert torch.equal(layout.phy2log, layer.replicas.phy2log)


@pytest.mark.parametrize("worker", ["inline", "process"])
def test_dense_model_is_refused(folder_of: Callable[[str], str], worker: str) -> None:
    with pytest.raises(ConfigError, match="eplb needs a model with MoE layers; this model has none"):
        build_engine(model=folder_of("qwen3"), eplb={}, worker=worker)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_the_worker_process_rebalances_like_the_engine_in_process(overlap: bool) -> None:
    """The balancer lives in the worker (its window fed there, weights moved there); the
    host's handle asks between steps. Same tokens, and the same plans at the same steps
    from the same windows as the in-process engine."""
    prompts = _prompts(13)
    common = {"block_size": 4, "max_num_batched_tokens": 40, "overlap": overlap,
              "eplb": REBALANCING | {"policy": "refine"}}
    local = build_engine(**common)
    want = _run(local, prompts)
    traces: list[StepTrace] = []
    engine = build_engine(worker="process", **common, trace=traces.append)
    try:
        assert _run(engine, prompts) == want
        here, there = local.balancer, engine.balancer
        assert here is not None and there is not None and len(here.history) >= 3
        assert [r.after_step for r in there.history] == [r.after_step for r in here.history]
        for a, b in zip(here.history, there.history):
            assert torch.equal(a.window, b.window) and torch.equal(a.phy2log, b.phy2log)
            assert a.moved_slots == b.moved_slots
        assert torch.equal(there.placement.phy2log, here.placement.phy2log)
        assert there.num_steps == here.num_steps
        rounds = [t for t in traces if t.chunks]
        assert rounds and all(t.slot_counts is not None for t in rounds)
        assert all(len(row) == 12 for t in rounds for row in t.slot_counts or [])
    finally:
        engine.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_rebalance_points_are_a_function_of_committed_rounds(overlap: bool) -> None:
    """The clock counts committed rounds with work: due once ``interval`` committed since
    the last plan; under overlap the round in flight commits before the weights move, so
    the points are ``interval, 2*interval, ...`` synchronous and ``interval+1, ...``
    overlapped, whatever the executor's thread has finished."""
    engine = build_engine(block_size=4, max_num_batched_tokens=40, overlap=overlap,
                          eplb=REBALANCING | {"interval": 2})
    _run(engine, _prompts(13))
    balancer = engine.balancer
    assert balancer is not None and len(balancer.history) >= 3
    step = 2 + int(overlap)
    assert [r.after_step for r in balancer.history] == [step * (i + 1) for i in range(len(balancer.history))]
    assert balancer.num_steps >= balancer.history[-1].after_step


def test_cli_picks_the_replica_selector() -> None:
    from deepinfer_kit.cli import build_parser
    from deepinfer_kit.cli_engine import engine_config

    args = build_parser().parse_args(["generate", "--eplb-interval", "4", "--eplb-dispatch", "balanced"])
    config = engine_config(args)
    assert config.eplb is not None and config.eplb.dispatch == "balanced"
    bad = build_parser().parse_args(["generate", "--eplb-interval", "4", "--eplb-dispatch", "lp"])
    with pytest.raises(ConfigError, match="eplb.dispatch must be one of"):
        engine_config(bad)
