"""VectorizedSampler against NaiveSampler (the oracle) over random batches, through every
candidate path, plus batch invariance at realistic vocabulary sizes and the regressions."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from deepinfer_kit.errors import ConfigError, DeviceUnavailableError, InvariantError
from deepinfer_kit.sample import NaiveSampler, SamplingParams, VectorizedSampler
from deepinfer_kit.sample import ref_ops
from deepinfer_kit.sample import vectorized as vectorized_module
from deepinfer_kit.sample.reference import filtered_distribution
from deepinfer_kit.testing.sample import make_batch


def _random_batch(rnd: random.Random, rows: int, vocab: int) -> tuple[Any, list[SamplingParams]]:
    params = []
    for i in range(rows):
        params.append(
            SamplingParams(
                temperature=rnd.choice([0.0, 0.4, 1.0, 1.0, 1.8]),
                top_k=rnd.choice([0, 0, 1, 3, 40, vocab // 2, vocab - 1, vocab]),
                top_p=rnd.choice([1.0, 1.0, 0.97, 0.8, 0.3]),
                min_p=rnd.choice([0.0, 0.0, 0.05, 0.5]),
                repetition_penalty=rnd.choice([1.0, 1.0, 0.8, 1.4]),
                frequency_penalty=rnd.choice([0.0, 0.0, 0.3, -0.5]),
                presence_penalty=rnd.choice([0.0, 0.7]),
                min_tokens=rnd.choice([0, 0, 3]),
                max_tokens=8,
                stop_token_ids=rnd.sample(range(vocab), 2),
                ignore_eos=rnd.random() < 0.2,
                seed=rnd.choice([None, rnd.randrange(2**63)]),
                logprobs=rnd.choice([None, None, 0, 4]),
            )
        )
    prompts = [[rnd.randrange(vocab) for _ in range(rnd.randrange(6))] for _ in range(rows)]
    outputs = [[rnd.randrange(vocab) for _ in range(rnd.randrange(5))] for _ in range(rows)]
    eos = [rnd.choice([None, rnd.randrange(vocab)]) for _ in range(rows)]
    positions = [len(o) for o in outputs]

    def build() -> Any:
        gen = torch.Generator().manual_seed(rnd_seed)
        return make_batch(params, positions=positions, prompts=prompts, outputs=outputs, eos=eos, generator=gen)

    rnd_seed = rnd.randrange(1000)
    return build, params


@pytest.mark.parametrize("seed", range(6))
def test_matches_naive_on_random_batches(seed: int) -> None:
    rnd = random.Random(seed)
    vocab = rnd.choice([2, 17, 300, 5000])
    rows = 48
    build, params = _random_batch(rnd, rows, vocab)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * rnd.choice([1.0, 4.0])
    logits[torch.rand(rows, vocab, generator=gen) < 0.1] = float("-inf")
    fast, slow = VectorizedSampler("ref")(logits, build()), NaiveSampler()(logits, build())
    assert torch.equal(fast.token_ids, slow.token_ids)
    if fast.logprobs is None:
        assert slow.logprobs is None
        return
    assert slow.logprobs is not None and fast.ranks is not None and fast.top_logprobs is not None
    assert slow.ranks is not None
    assert torch.allclose(fast.logprobs, slow.logprobs, atol=1e-5)
    assert torch.equal(fast.ranks, slow.ranks)
    assert slow.top_logprobs is not None and fast.top_token_ids is not None
    assert torch.allclose(fast.top_logprobs, slow.top_logprobs, atol=1e-5)


class _PathCounter:
    """Counts the rows each candidate path handled (wrapping the module's functions)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rows: Counter[str] = Counter()
        for name in ("topk_candidates", "threshold_candidates", "sorted_candidates"):
            monkeypatch.setattr(vectorized_module, name, self._wrap(name, getattr(vectorized_module, name)))
        monkeypatch.setattr(ref_ops, "nucleus_draw", self._wrap("nucleus_draw", ref_ops.nucleus_draw))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(x: torch.Tensor, rows: torch.Tensor, *args: Any) -> Any:
            self.rows[name] += rows.numel()
            return fn(x, rows, *args)

        return counted


def test_every_candidate_path_matches_naive(monkeypatch: pytest.MonkeyPatch) -> None:
    counter = _PathCounter(monkeypatch)
    vocab = 20_000
    gen = torch.Generator().manual_seed(0)
    flat = torch.randn(6, vocab, generator=gen) * 3  # top-p 0.9 needs ~1k tokens
    peaked = torch.randn(6, vocab, generator=gen)
    peaked[:, :30] += 12
    tied = torch.randn(6, vocab, generator=gen)
    tied[:, 100:400] = 9.0  # 300 tokens tied at the top
    logits = torch.cat([flat, peaked, tied])
    params = (
        [SamplingParams(top_p=0.9, seed=s) for s in range(6)]
        + [SamplingParams(top_p=0.9, top_k=20, seed=s) for s in range(3)]
        + [SamplingParams(top_k=6000, temperature=0.5, seed=s) for s in range(3)]
        + [SamplingParams(top_k=50, seed=s) for s in range(3)]
        + [SamplingParams(top_p=0.5, seed=s, min_p=0.5) for s in range(3)]
    )
    batch = make_batch(params)
    fast, slow = VectorizedSampler("ref")(logits, batch), NaiveSampler()(logits, batch)
    assert torch.equal(fast.token_ids, slow.token_ids)
    assert counter.rows["topk_candidates"] == 6  # top-k 20 (with top-p) and top-k 50
    assert counter.rows["threshold_candidates"] >= 3  # k > 4096
    assert counter.rows["nucleus_draw"] == 9  # top-p without top-k: flat (nuclei of ~1k), min-p


def _rows_like(target: SamplingParams, rnd: random.Random) -> Iterator[SamplingParams]:
    for _ in range(64):
        yield SamplingParams(
            temperature=rnd.choice([0.0, 0.7, 1.0]),
            top_k=rnd.choice([0, 5, 50, 5000]),
            top_p=rnd.choice([1.0, 0.9, 0.6]),
            min_p=rnd.choice([0.0, 0.1]),
            seed=rnd.choice([None, 1, 2]),
        )


@pytest.mark.parametrize(
    "target",
    [
        SamplingParams(seed=1),
        SamplingParams(seed=2, top_k=50),
        SamplingParams(seed=3, top_p=0.9),
        SamplingParams(seed=4, top_p=0.95, top_k=50, temperature=0.7),
        SamplingParams(seed=5, min_p=0.05, temperature=1.3),
        SamplingParams(seed=6, top_k=5000),
    ],
    ids=["full", "top_k", "top_p", "both", "min_p", "large_k"],
)
def test_batch_invariance_at_vocab_32k(target: SamplingParams) -> None:
    vocab = 32_000
    gen = torch.Generator().manual_seed(target.seed or 0)
    rnd = random.Random(target.seed)
    row = torch.randn(vocab, generator=gen) * 2.5
    sampler = VectorizedSampler("ref")
    alone = [int(sampler(row[None], make_batch([target], positions=[p])).token_ids) for p in range(3)]
    for slot, position in ((0, 0), (37, 1), (63, 2)):
        params = list(_rows_like(target, rnd))
        params[slot] = target
        logits = torch.randn(64, vocab, generator=gen) * 3
        logits[slot] = row
        positions = [rnd.randrange(9) for _ in range(64)]
        positions[slot] = position
        got = sampler(logits, make_batch(params, positions=positions)).token_ids[slot]
        assert int(got) == alone[position]
    assert bool(filtered_distribution(row, target)[alone].gt(0).all())


def test_regression_greedy_rows_with_neg_inf_never_nan() -> None:
    logits = torch.full((3, 8), float("-inf"))
    logits[1, 5] = -3.0
    logits[2, 2:4] = 1e30
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(top_k=1), SamplingParams(temperature=1e-30)]
    result = VectorizedSampler("ref")(logits, make_batch(params))
    assert result.token_ids.tolist()[:2] == [0, 5]
    assert result.token_ids.tolist()[2] in (2, 3)
    assert result.logprobs is not None and not bool(result.logprobs.isnan().any())


def test_regression_ties_at_topk_cut_never_let_k_plus_one_through() -> None:
    logits = torch.tensor([[3.0] + [2.0] * 200 + [0.0] * 50] * 2000)
    params = [SamplingParams(top_k=50, temperature=100.0, seed=s) for s in range(2000)]
    tokens = VectorizedSampler("ref")(logits, make_batch(params)).token_ids
    assert sorted(set(tokens.tolist())) == list(range(50))  # the lowest ids win ties


def test_half_precision_and_noncontiguous_logits() -> None:
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(40, 30, generator=gen)
    params = [SamplingParams(seed=s, top_k=4, repetition_penalty=1.2) for s in range(20)]
    batch = make_batch(params, prompts=[[1, 2]] * 20)
    sampler = VectorizedSampler("ref")
    for logits in (base[::2], base[::2].half(), base[::2].bfloat16()):
        got = sampler(logits, batch).token_ids
        assert torch.equal(got, NaiveSampler()(logits, batch).token_ids)


def test_unseeded_rows_advance_the_generator_by_one_draw_each() -> None:
    logits = torch.zeros(5, 10)
    params = [SamplingParams(), SamplingParams(seed=3), SamplingParams(temperature=0.0), SamplingParams(), SamplingParams()]
    gen, twin = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    VectorizedSampler("ref")(logits, make_batch(params, generator=gen))
    torch.rand(3, dtype=torch.float64, generator=twin)
    assert torch.equal(gen.get_state(), twin.get_state())


def test_bad_constructor_arguments_and_history() -> None:
    with pytest.raises(ConfigError, match="impl must be one of"):
        VectorizedSampler("cuda")  # type: ignore[arg-type]
    assert VectorizedSampler("ref").impl == "ref"
    with pytest.raises(InvariantError, match=r"output_token_ids\[0\] holds token 10"):
        batch = make_batch([SamplingParams(frequency_penalty=1.0)], outputs=[[10]])
        VectorizedSampler("ref")(torch.zeros(1, 10), batch)
    with pytest.raises(InvariantError, match="logits must be"):
        VectorizedSampler("ref")(torch.zeros(3), make_batch([SamplingParams()]))


def test_triton_without_cuda_or_interpreter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(DeviceUnavailableError, match="TRITON_INTERPRET"):
        VectorizedSampler("triton")
    assert VectorizedSampler("auto").impl == "ref"
