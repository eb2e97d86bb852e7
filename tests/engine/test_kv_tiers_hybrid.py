"""KV tiers under the hybrid cache (a 5 local : 1 global model, window 3, blocks of 4): a
tier block keeps every layer — the full-attention layer's K/V and each sliding layer's window
of it, in model order, the bytes a cache without layer groups keeps — so a prefix the device
lost comes back from the host or disk tier with its windows and nothing is recomputed.
Tokens are transformers' and each token's logprob is within 2e-4 of its log-softmax —
inline, overlapped, speculative, static batching, in a worker process, loads layerwise or
whole, from another engine's disk folder (one without layer groups too) and between prefill
and decode engines (a shared folder, or the device link); multi-turn conversations keep the device-only engine's tokens (greedy and
seeded), for a model whose every layer slides as well."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer_kit import SamplingParams, build_engine
from deepinfer_kit.cache.hybrid_kv import HybridKVCache
from deepinfer_kit.cache.tiers.hybrid import TieredHybridKVCacheManager
from deepinfer_kit.cache.tiers.manager import tiered
from deepinfer_kit.disagg import push_kv_down

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

from hf_models import five_to_one, hf_greedy_full, hf_logits, serve_in_turn  # noqa: E402

NEW = 8
_RNG = random.Random(12)
_PREFIX = [_RNG.randrange(160) for _ in range(40)]
# the prefix, three prompts that push it out of the device (24 blocks of 4), the prefix again
_PROMPTS = [_PREFIX + [1, 2, 3]] + [[_RNG.randrange(160) for _ in range(60)] for _ in range(3)] + [_PREFIX + [4, 5]]
_ENGINE = {"block_size": 4, "attention_impl": "ref", "max_num_seqs": 2, "num_blocks": 24,
           "max_num_batched_tokens": 64, "max_model_len": 96}


@pytest.fixture(scope="module")
def narrow(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("qwen2_5to1_w3")
    return folder, five_to_one(folder, 3, 5)


@pytest.fixture(scope="module")
def oracle(narrow: tuple[Path, Any]) -> list[tuple[list[int], torch.Tensor]]:
    """Per prompt: transformers' greedy tokens and their log-probabilities."""
    _, model = narrow
    out = []
    for p in _PROMPTS:
        tokens = hf_greedy_full(model, p, NEW)
        logp = torch.log_softmax(hf_logits(model, p + tokens[:-1])[len(p) - 1:], dim=-1)
        out.append((tokens, logp[torch.arange(NEW), tokens]))
    return out


def _serve(folder: Path, **config: Any) -> tuple[list[list[int]], list[list[float]], Any]:
    """Serve the prompts one at a time; tokens, logprobs and the (closed, idle) engine."""
    engine = build_engine(model=str(folder), **{**_ENGINE, **config})
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    tokens, logprobs = serve_in_turn(engine, _PROMPTS, params)
    engine.check_idle()
    engine.close()
    return tokens, logprobs, engine


def _check(oracle: list[tuple[list[int], torch.Tensor]], tokens: list[list[int]], logprobs: list[list[float]]) -> None:
    assert tokens == [t for t, _ in oracle]
    for (_, want), got in zip(oracle, logprobs):
        torch.testing.assert_close(torch.tensor(got), want, atol=2e-4, rtol=0)


@pytest.mark.parametrize("config", [
    pytest.param({}, id="inline"),
    pytest.param({"kv_tiers": {"host_blocks": 64, "layerwise_loads": False}}, id="whole-round-loads"),
    pytest.param({"overlap": True}, id="overlap"),
    pytest.param({"scheduler": "static"}, id="static"),
    pytest.param({"speculative": {"drafter": "ngram", "num_draft": 3}}, id="speculative"),
    pytest.param({"worker": "process"}, id="worker-process"),
    pytest.param({"worker": "process", "tensor_parallel": 2}, id="two-tp-ranks"),  # each rank its heads' slab
    pytest.param({"max_num_batched_tokens": 16}, id="small-rounds"),  # no replay has to fit a round
])
def test_a_prefix_from_the_host_tier_brings_its_windows(narrow: tuple[Path, Any], oracle: Any,
                                                        config: dict[str, Any]) -> None:
    folder, _ = narrow
    tokens, logprobs, engine = _serve(folder, **{"kv_tiers": {"host_blocks": 64}, **config})
    _check(oracle, tokens, logprobs)
    cache = engine.cache
    assert isinstance(cache, TieredHybridKVCacheManager)
    stats = tiered(cache).tier_stats  # type: ignore[union-attr]
    assert stats.loaded_tokens == 40 and stats.host_hits == 10  # the whole prefix from the tier
    assert cache.window_stats.replays == 0 and cache.window_stats.kept_tokens >= 40


def _slots(engine: Any) -> dict[bytes, torch.Tensor]:
    """Each host-tier block of ``engine`` (an inline one) by its key."""
    host = tiered(engine.cache).connector.host  # type: ignore[union-attr]
    slab = engine.runner.kv_transfer._slab  # noqa: SLF001
    return {host.key(s): slab[s] for s in range(host.capacity) if host.key(s) is not None}


def test_a_tier_block_holds_what_a_cache_without_groups_holds(narrow: tuple[Path, Any]) -> None:
    """Every layer in model order: the hybrid engine's host blocks equal, to float rounding,
    those of the same model with every layer in one pool (the sliding layers' rows read from
    their groups' blocks, the full layer's from its own)."""
    folder, _ = narrow
    slabs = []
    for hybrid in (True, False):
        engine = build_engine(model=str(folder), **_ENGINE, hybrid_kv_cache=hybrid,
                              kv_tiers={"host_blocks": 32, "hash_key": b"k" * 32})
        kv = engine.runner.kv_cache  # type: ignore[attr-defined]
        assert isinstance(kv, HybridKVCache) is hybrid
        assert tuple(engine.runner.kv_transfer._slab.shape[1:]) == (6, 2, 4, 2, 16)  # type: ignore[attr-defined]  # noqa: SLF001
        engine.add_request("p", _PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=1))
        engine.run()
        push_kv_down(engine)
        slabs.append(_slots(engine))
        engine.close()
    grouped, flat = slabs
    assert len(grouped) == len(flat) == 10 and grouped.keys() == flat.keys()
    for key, block in grouped.items():
        torch.testing.assert_close(block, flat[key], atol=1e-5, rtol=0)
        assert block.abs().sum(dim=(1, 2, 3, 4)).min() > 0  # no layer left empty


@pytest.mark.parametrize("writer", [True, False], ids=["hybrid-writer", "flat-writer"])
def test_a_prefix_from_disk_brings_its_windows(narrow: tuple[Path, Any], oracle: Any, tmp_path: Path,
                                               writer: bool) -> None:
    """A second engine over the first one's disk folder (as the decode side of
    disaggregation) serves the prefix from disk — whether the first one kept layer groups
    or not: their files are the same K/V, under the same fingerprint."""
    folder, _ = narrow
    tiers = {"host_blocks": 16, "disk_blocks": 64, "disk_path": str(tmp_path), "hash_key": b"h" * 32}
    first = build_engine(model=str(folder), **_ENGINE, hybrid_kv_cache=writer, kv_tiers=tiers)
    first.add_request("warm", _PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=1))
    first.run()
    push_kv_down(first)
    first.close()
    engine = build_engine(model=str(folder), **_ENGINE, kv_tiers=tiers)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    engine.add_request("again", _PROMPTS[-1], params, kv={"load_remote": True})
    (out,) = [o.outputs[0] for o in engine.run()]
    tokens = list(out.token_ids)
    _check(oracle[-1:], [tokens], [[lp[t].logprob for lp, t in zip(out.logprobs, tokens)]])
    cache = engine.cache
    assert tiered(cache).tier_stats.disk_hits == 10  # type: ignore[union-attr]
    assert cache.window_stats.replays == 0  # type: ignore[attr-defined]
    engine.check_idle()
    engine.close()


def _conversations(seed: int) -> list[list[int]]:
    """40 turns of 5 conversations over 2 system prompts (a conversation restarts past 80
    tokens): prefixes the small pool keeps losing to the tiers and getting back."""
    rng = random.Random(seed)
    systems = [[rng.randrange(160) for _ in range(20)] for _ in range(2)]
    history: dict[int, list[int]] = {}
    prompts = []
    for _ in range(40):
        c = rng.randrange(5)
        fresh = [rng.randrange(160) for _ in range(rng.randint(4, 12))]
        prompt = history.get(c, systems[c % 2]) + fresh
        history[c] = prompt if len(prompt) <= 80 else systems[c % 2] + fresh
        prompts.append(history[c])
    return prompts


def _tokens(folder: Path, prompts: list[list[int]], seeded: bool, **config: Any) -> tuple[list[list[int]], int]:
    engine = build_engine(model=str(folder), **{**_ENGINE, **config})
    out = []
    for i, p in enumerate(prompts):
        params = (SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=6, ignore_eos=True) if seeded
                  else SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        engine.add_request(str(i), p, params)
        out += [list(o.outputs[0].token_ids) for o in engine.run()]
    engine.check_idle()
    tiers = tiered(engine.cache)
    engine.close()
    return out, tiers.tier_stats.loaded_tokens if tiers is not None else 0


@pytest.mark.parametrize("seed, tiers, seeded", [(3, {"host_blocks": 64}, False), (4, {"host_blocks": 64}, False),
                                                 (4, {"host_blocks": 16, "disk_blocks": 200}, False),
                                                 (5, {"host_blocks": 64}, True),
                                                 (6, {"host_blocks": 64, "write_policy": "write_back"}, False)],
                         ids=["host-3", "host-4", "disk-4", "seeded-5", "write-back-6"])
def test_conversations_keep_the_device_only_tokens(narrow: tuple[Path, Any], seed: int, tiers: dict[str, Any],
                                                   seeded: bool, tmp_path: Path) -> None:
    """Prefixes the small pool keeps losing come back from the tiers into full-group blocks
    whose old idle windows must be forgotten, with windows saved while they were cached
    (a save whose window had gone is dropped). Greedy, and seeded nucleus sampling."""
    folder, _ = narrow
    prompts = _conversations(seed)
    reference, _ = _tokens(folder, prompts, seeded)
    if "disk_blocks" in tiers:
        tiers = {**tiers, "disk_path": str(tmp_path)}
    got, loaded = _tokens(folder, prompts, seeded, kv_tiers=tiers)
    assert loaded > 0
    assert got == reference


def test_a_model_whose_every_layer_slides_keeps_its_windows_in_the_tiers(tmp_path: Path) -> None:
    """Mistral (window 5, every layer sliding): the full group has no layers (its blocks are
    names); the tiers keep the sliding layers' windows and serve the conversations' prefixes."""
    from hf_models import make_checkpoint

    make_checkpoint("mistral-sliding", tmp_path)
    prompts = _conversations(7)
    reference, _ = _tokens(tmp_path, prompts, False)
    got, loaded = _tokens(tmp_path, prompts, False, kv_tiers={"host_blocks": 64})
    assert loaded > 0
    assert got == reference


def test_disaggregated_prefill_and_decode(narrow: tuple[Path, Any], oracle: Any, tmp_path: Path) -> None:
    """A prefill engine and a decode engine of the hybrid model sharing a folder: the decode
    side loads each prompt's blocks with their windows; transformers' tokens."""
    from deepinfer_kit.disagg import build_disaggregated
    from deepinfer_kit.engine.config import EngineConfig

    folder, _ = narrow
    d = build_disaggregated(EngineConfig(model=str(folder), **_ENGINE), tmp_path, host_blocks=32, disk_blocks=256)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    for i in (0, 1):
        d.add_request(str(i), _PROMPTS[i], params)
    outs = {o.request_id: o.outputs[0] for o in d.run()}
    for i in (0, 1):
        tokens = list(outs[str(i)].token_ids)
        _check(oracle[i:i + 1], [tokens], [[lp[t].logprob for lp, t in zip(outs[str(i)].logprobs, tokens)]])
    assert tiered(d.decode.cache).tier_stats.loaded_tokens == (10 + 14) * 4  # type: ignore[union-attr]  # every full block
    assert d.decode.cache.window_stats.replays == 0  # type: ignore[attr-defined]
    d.prefill.check_idle()
    d.decode.check_idle()
    d.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["synchronous", "overlap"])
def test_a_device_linked_pair_moves_every_layer_with_its_windows(narrow: tuple[Path, Any], oracle: Any,
                                                                  overlap: bool) -> None:
    """The device link under the hybrid cache: the prefill engine's send slots and the decode
    engine's landing slots hold every layer of a block (the sliding layers from their
    groups' window blocks); the decode side loads each prompt with its windows, no replay,
    transformers' tokens."""
    from deepinfer_kit.disagg import build_device_disaggregated
    from deepinfer_kit.disagg.device_link import link_connector
    from deepinfer_kit.engine.config import EngineConfig

    folder, _ = narrow
    d = build_device_disaggregated(EngineConfig(model=str(folder), **_ENGINE, overlap=overlap), send_slots=32)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    for i in (0, 1):
        d.add_request(str(i), _PROMPTS[i], params)
    outs = {o.request_id: o.outputs[0] for o in d.run()}
    for i in (0, 1):
        tokens = list(outs[str(i)].token_ids)
        _check(oracle[i:i + 1], [tokens], [[lp[t].logprob for lp, t in zip(outs[str(i)].logprobs, tokens)]])
    assert link_connector(d.decode).stats.loaded_tokens == (10 + 14) * 4  # every usable block
    assert d.decode.cache.window_stats.replays == 0  # type: ignore[attr-defined]
    d.prefill.check_idle()
    d.decode.check_idle()
    d.close()


def test_a_linked_prefill_engine_resends_its_own_prefix_hits_with_their_windows(narrow: tuple[Path, Any]) -> None:
    """The second prompt on the prefill engine takes the shared 40-token prefix (10 blocks)
    from its own cache; the sliding groups still hold those blocks' windows, so the blocks
    are sent again, every layer (the decode side may no longer hold them), and the decode
    side is told of every usable block of both prompts."""
    from deepinfer_kit.components import Components
    from deepinfer_kit.disagg import push_kv_down as push
    from deepinfer_kit.disagg.device_link import link_connector, link_receiver, link_to

    folder, _ = narrow
    key = b"w" * 32
    decode = build_engine(model=str(folder), **_ENGINE, components=Components(kv_connector=link_receiver(key)))
    prefill = build_engine(model=str(folder), **_ENGINE,
                           components=Components(kv_connector=link_to(decode, key, send_slots=32)))
    manager = prefill.cache.inner  # type: ignore[attr-defined]  # the full group's tiered manager
    told = []
    for i in (0, 4):
        prefill.add_request(str(i), _PROMPTS[i], SamplingParams(max_tokens=1), kv={"save_prompt": True})
        manager.watch_saves(str(i))
        prefill.run()
        push(prefill)
        told.append(manager.settled_saves(str(i)))
    usable = [(len(_PROMPTS[i]) - 1) // 4 for i in (0, 4)]
    assert told == usable
    assert link_connector(prefill).stats.saved_host == sum(usable)  # the 10 hit blocks went again
    assert prefill.cache.refused_saves == 0  # type: ignore[attr-defined]
    prefill.check_idle()
    decode.check_idle()
    prefill.close()
    decode.close()
