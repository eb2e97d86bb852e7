"""``impl="auto"`` picks the sampler's and the verifier's ops from the logits' device, not
from whether the machine has CUDA: an engine on ``device="cpu"`` on a GPU machine draws
with the torch ops (a compiled kernel cannot read CPU tensors). The GPU machine is
simulated: ``torch.cuda.is_available`` answers True and every Triton op raises."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepinfer_kit.spec.verify.rows import verify_padded

from deepinfer_kit import SamplingParams, build_engine
from deepinfer_kit.sample import ref_ops as sample_ref
from deepinfer_kit.sample.records import SamplingBatch
from deepinfer_kit.sample.vectorized import VectorizedSampler
from deepinfer_kit.spec.verify.greedy import GreedyVerifier
from deepinfer_kit.spec.records import DraftProposal

pytest.importorskip("triton")


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a Triton kernel was handed CPU tensors")


@pytest.fixture
def gpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    import deepinfer_kit.sample.triton_ops as sample_triton
    import deepinfer_kit.spec.verify.triton_ops as spec_triton

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("row_norm", "full_draw", "candidate_draw", "nucleus_draw"):
        monkeypatch.setattr(sample_triton, name, _refuse)
    for name in ("greedy_verify", "rejection_sample"):
        monkeypatch.setattr(spec_triton, name, _refuse)


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9),
            SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=1.0, top_k=7),
            SamplingParams(temperature=0.7, top_k=3, top_p=0.8, min_p=0.1)]


@pytest.mark.usefixtures("gpu_machine")
def test_auto_sampler_on_a_gpu_machine_draws_cpu_logits_with_the_torch_ops() -> None:
    import deepinfer_kit.sample.triton_ops as sample_triton

    sampler = VectorizedSampler("auto")
    assert sampler.impl == "auto"
    assert sampler.ops_for(torch.device("cpu")) is sample_ref
    assert sampler.ops_for(torch.device("cuda", 0)) is sample_triton
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(3))
    params = _params()

    def batch() -> SamplingBatch:
        return SamplingBatch.build(params, seeds=[11 + i for i in range(len(params))])

    got = sampler(logits, batch()).token_ids
    assert torch.equal(got, VectorizedSampler("ref")(logits, batch()).token_ids)


@pytest.mark.usefixtures("gpu_machine")
def test_auto_verifier_on_a_gpu_machine_verifies_cpu_logits_with_the_torch_ops() -> None:
    verifier = GreedyVerifier("auto")
    logits = torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(5))
    drafts = logits[:, :2].argmax(-1)
    proposal = DraftProposal(token_ids=drafts, num_drafted=[2, 2])
    batch = SamplingBatch.build([SamplingParams(temperature=0.0)] * 2)
    got = verify_padded(verifier, proposal, [2, 2], logits, batch)
    want = verify_padded(GreedyVerifier("ref"), proposal, [2, 2], logits, batch)
    assert got.token_ids == want.token_ids and got.num_accepted == [2, 2]


@pytest.mark.usefixtures("gpu_machine")
def test_a_cpu_engine_on_a_gpu_machine_serves_with_the_default_impls() -> None:
    engine = build_engine(device="cpu", num_blocks=32, block_size=8, max_model_len=64)
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=4))
    engine.add_request("b", [4, 5], SamplingParams(temperature=0.0, max_tokens=4))
    outputs = engine.run()
    assert sorted(len(o.outputs[0].token_ids) for o in outputs) == [4, 4]
    engine.check_idle()



@pytest.mark.cuda
def test_a_cpu_engine_on_a_real_gpu_machine_serves_sampling_and_speculation() -> None:
    engine = build_engine(device="cpu", num_blocks=32, block_size=8, max_model_len=64,
                          speculative={"num_draft": 2})
    rows = [SamplingParams(temperature=0.0, max_tokens=5),
            SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=5),
            SamplingParams(temperature=1.0, top_k=7, seed=2, max_tokens=5)]
    for i, params in enumerate(rows):
        engine.add_request(f"r{i}", [1, 2, 3, 1, 2, 3], params)
    outputs = engine.run()
    assert sorted(len(o.outputs[0].token_ids) for o in outputs) == [5, 5, 5]
    engine.check_idle()


@pytest.mark.parametrize("field", ["sampler_impl", "attention_impl", "moe_impl"])
def test_a_triton_impl_on_a_cpu_engine_without_the_interpreter_is_a_config_error(
    field: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Off the interpreter, "triton" on a CPU engine would hand CPU tensors to compiled
    kernels on a machine with a GPU; it is refused when the engine is built, naming it."""
    from deepinfer_kit import build_engine
    from deepinfer_kit.errors import ConfigError

    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match=rf"{field}='triton' with device 'cpu'"):
        build_engine(device="cpu", num_blocks=16, max_model_len=64, **{field: "triton"})
    build_engine(device="cpu", num_blocks=16, max_model_len=64, **{field: "auto"})
