"""The kit's sampler behind vLLM v1's Sampler and TopKTopPSampler interfaces: the same
greedy tokens as vLLM's Sampler, every sampled token inside vLLM's own top-k / top-p set,
seeded rows reproducible, what is not covered refused by name."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM's host classes are not importable here (install vllm 0.33)")

import torch
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler, apply_top_k_top_p
from vllm.v1.sample.sampler import Sampler

from deepinfer_kit.adapters import PeerVersionError
from deepinfer_kit.adapters.vllm import KitSampler
from deepinfer_kit.adapters.vllm.sampler import KitTopKTopPSampler
from deepinfer_kit.errors import ConfigError

pytestmark = pytest.mark.peers

V = 1000


def sampling_metadata(
    temperature: list[float],
    top_k: list[int] | None = None,
    top_p: list[float] | None = None,
    generators: dict[int, torch.Generator] | None = None,
    **extra: Any,
) -> SamplingMetadata:
    rows = len(temperature)
    temp = torch.tensor(temperature)
    greedy = [t < 1e-5 for t in temperature]
    fields: dict[str, Any] = dict(
        temperature=None if all(greedy) else temp,
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_p=None if top_p is None else torch.tensor(top_p),
        top_k=None if top_k is None else torch.tensor(top_k),
        generators=generators or {},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(rows),
        presence_penalties=torch.zeros(rows),
        repetition_penalties=torch.ones(rows),
        output_token_ids=[[] for _ in range(rows)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )
    fields.update(extra)
    return SamplingMetadata(**fields)


def _logits(rows: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * scale


def test_greedy_rows_equal_vllm_sampler() -> None:
    kit, peer = KitSampler(), Sampler()
    for seed in range(5):
        logits = _logits(16, seed)
        md = sampling_metadata([0.0] * 16)
        want = peer(logits.clone(), md).sampled_token_ids
        got = kit(logits, md).sampled_token_ids
        assert got.dtype == want.dtype and got.shape == want.shape == (16, 1)
        assert torch.equal(got, want)
    # a mixed batch: the greedy rows still match, whatever the sampled rows draw
    temps = [0.0, 0.7, 0.0, 1.3] * 4
    md = sampling_metadata(temps, top_k=[50] * 16, top_p=[0.9] * 16)
    logits = _logits(16, 9)
    got = kit(logits, md).sampled_token_ids[:, 0]
    want = peer(logits.clone(), md).sampled_token_ids[:, 0]
    greedy = torch.tensor([t == 0.0 for t in temps])
    assert torch.equal(got[greedy], want[greedy])


@pytest.mark.parametrize(
    "top_k, top_p", [([20] * 8, None), (None, [0.8] * 8), ([5, 50, 1000, 1, 10, 100, 2, 999], [0.5, 0.9, 1.0, 0.3] * 2)]
)
def test_sampled_tokens_lie_in_vllms_filtered_set(top_k: list[int] | None, top_p: list[float] | None) -> None:
    """vLLM's own ``apply_top_k_top_p`` on the temperature-scaled logits defines the set;
    60 draws per row all fall inside it, through both interfaces."""
    kit, topk_topp = KitSampler(), KitTopKTopPSampler()
    temps = [0.5, 1.0, 1.5, 0.8] * 2
    md = sampling_metadata(temps, top_k=top_k, top_p=top_p)
    logits = _logits(8, 3)
    scaled = logits / torch.tensor(temps).unsqueeze(1)
    k = None if top_k is None else torch.tensor(top_k)
    p = None if top_p is None else torch.tensor(top_p)
    allowed = torch.isfinite(apply_top_k_top_p(scaled.clone(), k, p))
    seen = torch.zeros_like(allowed)
    for _ in range(60):
        tok = kit(logits, md).sampled_token_ids[:, 0].long()
        tok2, _ = topk_topp.forward(scaled, {}, k, p)
        for t in (tok, tok2):
            assert allowed.gather(1, t.unsqueeze(1)).all()
            seen.scatter_(1, t.unsqueeze(1), True)
    assert (seen.sum(dim=1) > 1).any()  # it samples, not argmax


def test_native_vllm_topk_topp_agrees_on_the_set() -> None:
    """The reference itself: vLLM's TopKTopPSampler draws inside the same set (the check
    above would pass vacuously if the set were wrong for both)."""
    logits = _logits(8, 4)
    k, p = torch.tensor([20] * 8), torch.tensor([0.8] * 8)
    allowed = torch.isfinite(apply_top_k_top_p(logits.clone(), k, p))
    tok, _ = TopKTopPSampler().forward_native(logits.clone(), {}, k, p)
    assert allowed.gather(1, tok.long().unsqueeze(1)).all()


def test_seeded_rows_are_reproducible_and_seed_dependent() -> None:
    kit = KitSampler()
    logits = torch.zeros(4, V)  # flat: any token may come

    def draw(seed: int) -> list[int]:
        gens = {i: torch.Generator().manual_seed(seed + i) for i in range(4)}
        md = sampling_metadata([1.0] * 4, generators=gens)
        return [int(t) for _ in range(3) for t in kit(logits, md).sampled_token_ids[:, 0]]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


def test_what_is_not_covered_is_refused_by_name() -> None:
    kit = KitSampler()
    with pytest.raises(ConfigError, match="logprobs"):
        kit(_logits(2, 0), sampling_metadata([1.0, 1.0], max_num_logprobs=1))
    with pytest.raises(ConfigError, match="penalties"):
        kit(_logits(2, 0), sampling_metadata([1.0, 1.0], no_penalties=False))


def test_untested_vllm_version_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepinfer_kit.adapters import _peers

    monkeypatch.setattr(_peers.metadata, "version", lambda name: "0.32.1")
    with pytest.raises(PeerVersionError, match=r"vllm 0\.32\.1 is installed.*tested with vllm 0\.33"):
        KitSampler()
