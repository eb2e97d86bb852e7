"""gpt-oss through the whole engine: attention sinks, sliding (window 5) and full layers
alternating, and its biased clamped-SwiGLU MoE on every layer. Greedy tokens equal
transformers' for prompts longer than the window and decodes past it, with chunked prefill
and prefix-cache hits, on the torch references and on the Triton MoE kernels (the
interpreter on CPU); a batch-invariant engine is refused."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest

from deepinfer_kit import SamplingParams, build_engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

from hf_models import hf_greedy_full, make_checkpoint  # noqa: E402



@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("gpt_oss")
    return folder, make_checkpoint("gpt_oss", folder, seed=2)


# The interpreted kernels are slow on the CPU: the Triton case runs the MoE kernels with
# their bias and clamp options (the sink attention kernel's model-level check is in
# tests/models/test_gpt_oss.py) on the two prompts that share a prefix (a cache hit), for
# fewer tokens, still decoding past the window.
@pytest.mark.parametrize(("config", "num_prompts", "new_tokens"), [
    pytest.param({"attention_impl": "ref", "moe_impl": "ref"}, 3, 10, id="ref"),
    pytest.param({"attention_impl": "ref", "moe_impl": "triton", "max_num_batched_tokens": 16,
                  "block_size": 8}, 2, 6, id="triton-moe-chunked", marks=pytest.mark.triton),
])
def test_greedy_tokens_equal_transformers(gpt_oss: tuple[Path, Any], config: dict[str, Any],
                                          num_prompts: int, new_tokens: int) -> None:
    folder, hf_model = gpt_oss
    rng = random.Random(4)
    shared = [rng.randrange(160) for _ in range(17)]
    prompts = [shared + [rng.randrange(160) for _ in range(n)] for n in (3, 11)] + [[rng.randrange(160)] * 2]
    prompts = prompts[:num_prompts]
    engine = build_engine(model=str(folder), **config)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ids = [engine.add_request(None, p, params) for p in prompts]
    outs = {o.request_id: o for o in engine.run()}
    engine.check_idle()
    assert [outs[i].outputs[0].token_ids for i in ids] == [hf_greedy_full(hf_model, p, new_tokens) for p in prompts]


def test_batch_invariant_engine_is_refused(gpt_oss: tuple[Path, Any]) -> None:
    from deepinfer_kit.errors import ConfigError

    folder, _ = gpt_oss
    with pytest.raises(ConfigError, match="batch_invariant=True is not supported for GptOssForCausalLM"):
        build_engine(model=str(folder), batch_invariant=True)


def test_eplb_rebalances_its_biased_experts_and_keeps_the_tokens(gpt_oss: tuple[Path, Any]) -> None:
    """EPLB over gpt-oss: replicas and rebalances move the experts' biases with their
    weights (a slot's bytes count them), and greedy tokens stay transformers'."""
    folder, hf_model = gpt_oss
    rng = random.Random(9)
    prompts = [[rng.randrange(160) for _ in range(n)] for n in (13, 9, 21)]
    engine = build_engine(model=str(folder), attention_impl="ref", moe_impl="ref",
                          eplb={"window": 2, "interval": 2, "num_redundant": 2, "num_gpus": 2})
    balancer = engine.balancer
    assert balancer is not None
    experts = balancer.layers[0].experts
    assert experts.gate_up_bias is not None and experts.down_bias is not None
    assert balancer.expert_bytes == sum(t[0].numel() * t.element_size() for t in experts.slot_tensors())
    assert balancer.expert_bytes > experts.gate_up[0].numel() * experts.gate_up.element_size() + (
        experts.down[0].numel() * experts.down.element_size())
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ids = [engine.add_request(None, p, params) for p in prompts]
    outs = {o.request_id: o for o in engine.run()}
    engine.check_idle()
    assert balancer.history, "no rebalance ran"
    assert [outs[i].outputs[0].token_ids for i in ids] == [hf_greedy_full(hf_model, p, 8) for p in prompts]
