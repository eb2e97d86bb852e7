"""target_probs: the sampler's own distribution as probabilities, equal to the float64 spec."""

from __future__ import annotations

import torch

from deepinfer_kit.sample.distribution import target_probs
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sample.records import SamplingBatch
from deepinfer_kit.sample.reference import filtered_distribution
from deepinfer_kit.sample.vectorized import working_logits


def test_target_probs_equal_the_spec_row_by_row() -> None:
    g = torch.Generator().manual_seed(0)
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, repetition_penalty=rp,
                       frequency_penalty=fp, min_tokens=mt)
        for t in (0.0, 0.6, 1.4) for k in (0, 1, 4) for p in (1.0, 0.75) for m in (0.0, 0.2)
        for rp, fp, mt in ((1.0, 0.0, 0), (1.3, 0.5, 3))
    ]
    n, vocab = len(params), 40
    logits = torch.randn(n, vocab, generator=g)
    logits[5, ::2] = float("-inf")
    logits[6] = float("-inf")
    logits[7, :9] = 3.0  # ties at the top-k cut
    batch = SamplingBatch(params, [None] * n, [0] * n, [[1, 2, 3]] * n,
                          [[4, 4, 5]] * n, [2] * n)
    got = target_probs(logits, batch)
    x = working_logits(logits, batch)
    want = torch.stack([filtered_distribution(x[i], params[i]) for i in range(n)])
    assert torch.equal(got, want)
    assert torch.allclose(got.sum(dim=1), torch.ones(n, dtype=torch.float64))
