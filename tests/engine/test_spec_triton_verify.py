"""The engine's ``sampler_impl="triton"`` verifies with the Triton kernels (under the
interpreter on CPU) and emits exactly the tokens of the torch reference: greedy n-gram
drafts and seeded sampling with a draft model's probabilities (strict rejection sampling)."""

from __future__ import annotations

from typing import Any

import pytest

from deepinfer_kit import SamplingParams, build_engine

pytestmark = pytest.mark.triton


def _run(impl: str, spec: dict[str, Any], params: SamplingParams) -> list[list[int]]:
    engine = build_engine(speculative=spec, sampler_impl=impl, num_blocks=64, max_model_len=256)
    assert engine.runner.verifier is not None
    assert engine.runner.verifier.impl == impl  # type: ignore[attr-defined]
    for i, prompt in enumerate(([5, 6, 7, 5, 6, 7, 5, 6], [40, 41, 42, 43, 40, 41])):
        engine.add_request(f"r{i}", prompt, params)
    outs = {o.request_id: o.outputs[0].token_ids for o in engine.run()}
    engine.check_idle()
    return [outs[k] for k in sorted(outs)]


@pytest.mark.parametrize("spec, params", [
    ({"num_draft": 3}, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
    ({"drafter": "draft_model", "draft_model": "tiny", "num_draft": 3},
     SamplingParams(temperature=0.9, top_k=40, seed=7, max_tokens=10, ignore_eos=True)),
])
def test_triton_verification_equals_the_reference(spec: dict[str, Any], params: SamplingParams) -> None:
    assert _run("triton", spec, params) == _run("ref", spec, params)
