"""The verification kernels against their torch references (under the interpreter on CPU),
and the verifiers built on each giving the same tokens from the same uniforms."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kit.spec.verify.rows import verify_padded
from kernel_compile import assert_kernels_compile

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sample.records import SamplingBatch
from deepinfer_kit.sample.vectorized import VectorizedSampler
from deepinfer_kit.spec.verify import ref_ops
from deepinfer_kit.spec.verify.greedy import GreedyVerifier
from deepinfer_kit.spec.records import DraftProposal
from deepinfer_kit.spec.verify.rejection import RejectionVerifier

pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def triton_ops():  # type: ignore[no-untyped-def]
    from deepinfer_kit.spec.verify import triton_ops as module

    return module


def _lengths(gen: torch.Generator, num_req: int, width: int) -> torch.Tensor:
    lengths = torch.randint(0, width + 1, (num_req,), generator=gen)
    lengths[0] = 0
    lengths[-1] = width
    return lengths


def _drafts_like(top: torch.Tensor, gen: torch.Generator, num_req: int, width: int,
                 vocab: int) -> torch.Tensor:
    """Drafts that equal ``top [R, G]`` at random positions (so runs of acceptances occur)."""
    ids = torch.randint(0, vocab, (num_req, width), generator=gen)
    keep = torch.rand(num_req, width, generator=gen) < 0.75
    return torch.where(keep, top, ids)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("vocab", [1, 7, 1500])
def test_greedy_verify_matches(triton_ops, seed: int, vocab: int) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    num_req, width = 9, seed % 5
    lengths = _lengths(gen, num_req, width)
    offsets = torch.cumsum(lengths + 1, 0) - (lengths + 1)
    logits = torch.randn(int((lengths + 1).sum()), vocab, generator=gen)
    logits[torch.rand(logits.shape, generator=gen) < 0.2] = float("-inf")
    logits[0] = float("-inf")  # nothing finite: token 0
    logits[1, : min(3, vocab)] = 50.0  # a tie: the lowest id
    top = logits.argmax(-1)
    at = offsets.unsqueeze(1) + torch.minimum(torch.arange(width), lengths.unsqueeze(1))
    ids = _drafts_like(top[at], gen, num_req, width, vocab)
    ref = ref_ops.greedy_verify(logits, offsets, ids, lengths)
    tri = triton_ops.greedy_verify(logits, offsets, ids, lengths)
    assert torch.equal(ref[0], tri[0]) and torch.equal(ref[1], tri[1])
    assert bool((ref[0] >= 0).all() and (ref[0] <= lengths).all() and (ref[1] < vocab).all())


def _distributions(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    logits = torch.randn(shape, generator=gen, dtype=torch.float64) * 2
    logits[torch.rand(shape, generator=gen) < 0.3] = float("-inf")
    logits[..., 0] = 0.0  # every row keeps a token
    return torch.softmax(logits, dim=-1)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("vocab", [1, 7, 2500])
def test_rejection_sample_matches(triton_ops, seed: int, vocab: int) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(100 + seed)
    num_req, width = 10, 1 + seed % 4
    target = _distributions(gen, (num_req, width + 1, vocab))
    draft = _distributions(gen, (num_req, width, vocab))
    draft[1] = target[1, :width]  # residual all zero: the draw falls back to p_t
    target[2, :, : vocab // 2] = 0.0  # mass only in the upper half
    target[2] /= target[2].sum(-1, keepdim=True)
    ids = _drafts_like(target[:, :width].argmax(-1), gen, num_req, width, vocab)
    lengths = _lengths(gen, num_req, width)
    u_acc = torch.rand(num_req, width, generator=gen, dtype=torch.float64)
    u_draw = torch.rand(num_req, width + 1, generator=gen, dtype=torch.float64)
    u_draw[3], u_draw[4] = 0.0, 1.0 - 2.0**-53  # the ends of the CDF
    ref = ref_ops.rejection_sample(target, draft, ids, lengths, u_acc, u_draw)
    tri = triton_ops.rejection_sample(target, draft, ids, lengths, u_acc, u_draw)
    assert torch.equal(ref[0], tri[0]) and torch.equal(ref[1], tri[1])
    assert bool((ref[1] >= 0).all() and (ref[1] < vocab).all())


def test_ops_take_empty_drafts_and_no_requests(triton_ops) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(0)
    target = _distributions(gen, (3, 1, 11))
    none = torch.zeros(3, 0, dtype=torch.float64)
    for ops in (ref_ops, triton_ops):
        acc, tok = ops.rejection_sample(target, torch.zeros(3, 0, 11, dtype=torch.float64),
                                        torch.zeros(3, 0, dtype=torch.int64), torch.zeros(3, dtype=torch.int64),
                                        none, torch.full((3, 1), 0.5, dtype=torch.float64))
        assert acc.tolist() == [0, 0, 0]
        assert tok.tolist() == ref_ops.inverse_cdf(target[:, 0], torch.full((3,), 0.5)).tolist()
        acc, tok = ops.greedy_verify(torch.zeros(0, 5), torch.zeros(0, dtype=torch.int64),
                                     torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
        assert acc.shape == tok.shape == (0,)


V = 40


def _batch(params: list[SamplingParams], seeds: list[int | None]) -> SamplingBatch:
    n = len(params)
    return SamplingBatch(
        params=params, seeds=seeds, positions=[3] * n, prompt_token_ids=[[1, 2]] * n,
        output_token_ids=[[4, 5, 4]] * n, eos_token_ids=[None] * n,
        generator=torch.Generator().manual_seed(9),
    )


@pytest.mark.parametrize("probabilistic", [False, True])
def test_verifiers_give_the_same_tokens_on_either_impl(probabilistic: bool) -> None:
    """Same uniforms in, same tokens out: penalties, seeds, filters and greedy rows mixed."""
    gen = torch.Generator().manual_seed(7)
    num_req, width = 12, 4
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.2),
              SamplingParams(temperature=0.8, top_k=9, seed=3),
              SamplingParams(temperature=1.2, top_p=0.85, frequency_penalty=0.4),
              SamplingParams(temperature=1.0, min_p=0.05)] * 3
    seeds: list[int | None] = [None, 3, None, 11] * 3
    logits = torch.randn(num_req, width + 1, V, generator=gen) * 2
    ids = torch.where(torch.rand(num_req, width, generator=gen) < 0.7,
                      logits[:, :width].argmax(-1), torch.randint(0, V, (num_req, width), generator=gen))
    probs = torch.softmax(logits[:, :width] + torch.randn(num_req, width, V, generator=gen), -1)
    proposal = DraftProposal(ids, [width] * num_req, probs if probabilistic else None)
    lengths = [0, 1, 2, 3, 4, 4, 2, 4, 1, 3, 4, 0]
    sampler = VectorizedSampler("ref")
    for make in (lambda impl: RejectionVerifier(sampler, impl), lambda impl: GreedyVerifier(impl)):
        ref, tri = make("ref"), make("triton")
        assert (ref.impl, tri.impl) == ("ref", "triton")
        a = verify_padded(ref, proposal, lengths, logits, _batch(params, seeds))
        b = verify_padded(tri, proposal, lengths, logits, _batch(params, seeds))
        assert a.token_ids == b.token_ids and a.num_accepted == b.num_accepted


def test_an_unknown_impl_is_rejected() -> None:
    with pytest.raises(ConfigError, match="impl"):
        GreedyVerifier("fast")  # type: ignore[arg-type]


_SIGNATURES = {
    "_greedy_kernel": "x_ptr:*fp32 off_ptr:*i64 ids_ptr:*i64 len_ptr:*i64 acc_ptr:*i64 "
    "tok_ptr:*i64 stride:i32 G:i32 V:i32",
    "_rejection_kernel": "t_ptr:*fp64 d_ptr:*fp64 ids_ptr:*i64 len_ptr:*i64 ua_ptr:*fp64 "
    "ud_ptr:*fp64 acc_ptr:*i64 tok_ptr:*i64 G:i32 V:i32",
}


def test_kernels_compile_for_a_cuda_target(triton_ops) -> None:  # type: ignore[no-untyped-def]
    """Both kernels compile for sm_90 (see tests/kernel_compile.py)."""
    block = {"BLOCK": triton_ops.BLOCK}
    assert_kernels_compile("deepinfer_kit.spec.verify.triton_ops", _SIGNATURES,
                           {name: block for name in _SIGNATURES}, ("G", "V", "stride"))
