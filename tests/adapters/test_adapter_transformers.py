"""The kit's scheduler and block manager inside transformers' continuous batching: greedy
tokens identical to transformers' own FIFO scheduler, prefix hits in the kit's stats."""

from __future__ import annotations

import collections
import functools
import random
from typing import Any

import pytest

pytest.importorskip("transformers", reason="the transformers adapter needs transformers installed")

import torch
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from deepinfer_kit.adapters import PeerVersionError, peer_version
from deepinfer_kit.adapters.transformers import (
    TESTED_TRANSFORMERS,
    ClaimedBlocks,
    KitScheduler,
    kit_scheduler,
)
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sched.records import SchedulerConfig

pytestmark = pytest.mark.peers

_INSTALLED = peer_version("transformers") or ""
if not any(_INSTALLED == t or _INSTALLED.startswith(t + ".") for t in TESTED_TRANSFORMERS):
    pytest.skip(
        f"transformers {_INSTALLED} is not a version the adapter was tested with "
        f"({', '.join(TESTED_TRANSFORMERS)}); it would refuse to run",
        allow_module_level=True,
    )

VOCAB = 256


@functools.cache
def _tiny(family: str) -> Any:
    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common)).eval()
    else:
        model = LlamaForCausalLM(LlamaConfig(**common)).eval()
    model.config._attn_implementation = "sdpa"
    return model


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model(request: pytest.FixtureRequest) -> Any:
    """Each model family (the targets' two)."""
    return _tiny(request.param)


@pytest.fixture(scope="module")
def qwen3() -> Any:
    """One family, for the policy variants."""
    return _tiny("qwen3")


def _prompts(n: int, lo: int, hi: int, seed: int, prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    head = prefix or []
    return [head + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _generate(
    model: Any,
    prompts: list[list[int]],
    scheduler: str,
    *,
    num_blocks: int = 48,
    max_batch_tokens: int = 128,
    max_new_tokens: int = 12,
    eos: int | None = None,
) -> dict[str, list[int]]:
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0)
    cb = ContinuousBatchingConfig(
        page_size=16,
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        scheduler_type=scheduler,
        use_async_batching=False,
    )
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, warmup=False)
    return {rid: list(o.generated_tokens) for rid, o in out.items()}


def test_greedy_tokens_equal_fifo_on_32_mixed_requests_with_preemption(model: Any) -> None:
    """32 prompts of 3..90 tokens through a pool too small for all of them: the kit
    preempts by recompute and chunks long prompts, and every token equals FIFO's."""
    prompts = _prompts(32, 3, 90, seed=1)
    want = _generate(model, prompts, "fifo")
    with kit_scheduler("kit-test") as factory:
        got = _generate(model, prompts, "kit-test")
    sched = factory.last
    assert got == want
    assert len(got) == 32 and all(len(t) == 12 for t in got.values())
    assert sched.num_preemptions > 0  # the small pool forced the preemption rule
    assert sched.kit.num_unfinished == 0  # idle check ran in has_pending_requests


def test_static_batching_and_eos_stops_match_fifo(qwen3: Any) -> None:
    """16 requests under static batching (whole-life reservation, no preemption) with an EOS that stops some
    requests early: same tokens as FIFO, and the static policy never preempts."""
    prompts = _prompts(16, 3, 60, seed=2)
    plain = _generate(qwen3, prompts, "fifo", num_blocks=64)
    counts = collections.Counter(t for toks in plain.values() for t in toks[1:])
    eos = counts.most_common(1)[0][0]  # a token many requests generate: they stop early
    want = _generate(qwen3, prompts, "fifo", num_blocks=64, eos=eos)
    with kit_scheduler("kit-static", batching="static") as factory:
        got = _generate(qwen3, prompts, "kit-static", num_blocks=64, eos=eos)
    assert got == want
    assert any(len(t) < 12 for t in got.values()) and any(len(t) == 12 for t in got.values())
    assert factory.last.num_preemptions == 0


def test_chunked_prefill_under_a_small_budget_matches_fifo(qwen3: Any) -> None:
    """Prompts up to 200 tokens under a 48-token budget with a 32-token prefill cap: every
    prompt is split into chunks, and the tokens equal FIFO's."""
    prompts = _prompts(6, 100, 200, seed=3)
    config = SchedulerConfig(
        max_num_seqs=16, max_num_batched_tokens=48, max_model_len=512, long_prefill_token_threshold=32
    )
    want = _generate(qwen3, prompts, "fifo", num_blocks=96, max_batch_tokens=48)
    with kit_scheduler("kit-chunk", config=config) as factory:
        got = _generate(qwen3, prompts, "kit-chunk", num_blocks=96, max_batch_tokens=48)
    assert got == want
    assert factory.last.num_rounds >= sum(len(p) for p in prompts) // 48


def test_repeated_prefix_hits_in_kit_stats_and_tokens_equal_fifo(model: Any) -> None:
    """16 requests sharing a 64-token prefix: the later ones reuse the kit's published
    blocks (hits in its stats), with tokens identical to FIFO's."""
    prefix = _prompts(1, 64, 65, seed=4)[0]
    prompts = _prompts(16, 4, 20, seed=5, prefix=prefix)
    want = _generate(model, prompts, "fifo", num_blocks=96)
    with kit_scheduler("kit-prefix") as factory:
        got = _generate(model, prompts, "kit-prefix", num_blocks=96)
    stats = factory.last.prefix_stats
    assert got == want
    assert stats is not None and stats.hit_blocks >= 4 * 8  # >= 8 requests hit all 4 blocks


def test_round_reading_more_kv_than_the_read_budget_runs_in_several_batches(qwen3: Any) -> None:
    """A 24-block pool gives transformers a 384-token KV read budget; 16 requests over one
    64-token cached prefix read more in one round, so the adapter hands the round over
    in several batches — with the same tokens as FIFO."""
    prefix = _prompts(1, 64, 65, seed=7)[0]
    prompts = _prompts(16, 2, 8, seed=8, prefix=prefix)
    want = _generate(qwen3, prompts, "fifo", num_blocks=24, max_new_tokens=6)
    with kit_scheduler("kit-split") as factory:
        got = _generate(qwen3, prompts, "kit-split", num_blocks=24, max_new_tokens=6)
    assert got == want
    assert factory.last.num_batches > factory.last.num_rounds


def test_untested_transformers_version_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepinfer_kit.adapters import _peers

    monkeypatch.setattr(_peers.metadata, "version", lambda name: "5.23.1")
    with pytest.raises(PeerVersionError, match=r"transformers 5\.23\.1 is installed.*tested with transformers 5\.24"):
        KitScheduler(object(), None, 8)


class _FakeCache:
    def __init__(self, types: list[str]) -> None:
        self.cache_allocators = {t: object() for t in types}


def test_sliding_window_cache_is_rejected() -> None:
    with pytest.raises(ConfigError, match="sliding-window layers are not covered"):
        ClaimedBlocks(_FakeCache(["full_attention", "sliding_attention"]))
