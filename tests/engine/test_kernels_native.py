"""On a GPU, the Triton kernels compiled natively (never the interpreter: the ``cuda`` tier
runs with it off) against their torch references on the same CUDA tensors: the sampler's
draws, the verify kernels, the KV write and block copy. (Attention, the fused norms, RoPE
and the MoE layer have their own ``cuda`` tests beside their CPU ones.) Skipped without
CUDA."""

from __future__ import annotations

import os

import pytest
import torch

from deepinfer_kit.cache import ref_ops as cache_ref
from deepinfer_kit.sample import ref_ops as sample_ref
from deepinfer_kit.sample.candidates import sorted_candidates
from deepinfer_kit.spec.verify import ref_ops as spec_ref

pytestmark = pytest.mark.cuda
DEV = "cuda"


def test_the_interpreter_is_off() -> None:
    assert os.environ.get("TRITON_INTERPRET") != "1"
    from deepinfer_kit.sample import triton_ops

    assert type(triton_ops._full_draw_kernel).__name__ == "JITFunction"


def _logits(seed: int, rows: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen) * (1 + 3 * torch.rand(rows, 1, generator=gen))
    x[torch.rand(rows, vocab, generator=gen) < 0.3] = float("-inf")
    x[1] = float("-inf")
    x[3] = 1.0  # all tied
    return x.to(DEV), torch.randperm(rows, generator=gen).to(DEV), gen


def _row_params(gen: torch.Generator, n: int) -> tuple[torch.Tensor, ...]:
    inv_t = (0.3 + 2 * torch.rand(n, generator=gen)).float().to(DEV)
    min_p = torch.where(torch.rand(n, generator=gen) < 0.5, 0.0,
                        0.2 * torch.rand(n, generator=gen)).float().to(DEV)
    p = torch.where(torch.rand(n, generator=gen) < 0.3, 1.0,
                    torch.rand(n, generator=gen).double()).to(DEV)
    u = torch.rand(n, dtype=torch.float64, generator=gen).to(DEV)
    return inv_t, min_p, p, u


@pytest.mark.parametrize("vocab", [7, 4096, 151936])
def test_sampler_draws_match_the_reference(vocab: int) -> None:
    from deepinfer_kit.sample import triton_ops

    x, rows, gen = _logits(vocab, 24, vocab)
    inv_t, min_p, p, u = _row_params(gen, rows.numel())
    assert torch.allclose(sample_ref.row_norm(x, rows, inv_t), triton_ops.row_norm(x, rows, inv_t),
                          rtol=1e-5)
    assert torch.equal(sample_ref.full_draw(x, rows, inv_t, min_p, u),
                       triton_ops.full_draw(x, rows, inv_t, min_p, u))
    assert torch.equal(sample_ref.nucleus_draw(x, rows, inv_t, p, min_p, u),
                       triton_ops.nucleus_draw(x, rows, inv_t, p, min_p, u))
    for width in sorted({1, 33, 1500, min(vocab, 5000)}):
        vals, idx = sorted_candidates(x, rows)
        vals, idx = vals[:, :width].contiguous(), idx[:, :width].contiguous()
        k = torch.randint(1, width + 3, (rows.numel(),), generator=gen).to(DEV)
        z = torch.zeros_like(p)
        want = sample_ref.candidate_draw(vals, idx, inv_t, k, p, min_p, z, u)
        got = triton_ops.candidate_draw(vals, idx, inv_t, k, p, min_p, z, u)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]), width


@pytest.mark.parametrize("width", [0, 1, 4])
def test_verify_kernels_match_the_reference(width: int) -> None:
    from deepinfer_kit.spec.verify import triton_ops

    gen = torch.Generator().manual_seed(width)
    reqs, vocab = 5, 32000
    logits = torch.randn(reqs * (width + 1), vocab, generator=gen).to(DEV)
    offsets = torch.arange(reqs, dtype=torch.int64, device=DEV) * (width + 1)
    drafts = logits.view(reqs, width + 1, vocab)[:, :width].argmax(-1).contiguous()
    drafts[::2, width // 2 :] = 7  # some rejected
    lengths = torch.randint(0, width + 1, (reqs,), generator=gen).to(DEV)
    want = spec_ref.greedy_verify(logits, offsets, drafts, lengths)
    got = triton_ops.greedy_verify(logits, offsets, drafts, lengths)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    target = logits.view(reqs, width + 1, vocab).double().softmax(-1)
    draft_probs = torch.rand(reqs, width, vocab, generator=gen, dtype=torch.float64).to(DEV)
    draft_probs /= draft_probs.sum(-1, keepdim=True).clamp(min=1e-30)
    u_acc = torch.rand(reqs, width, dtype=torch.float64, generator=gen).to(DEV)
    u_draw = torch.rand(reqs, width + 1, dtype=torch.float64, generator=gen).to(DEV)
    want = spec_ref.rejection_sample(target, draft_probs, drafts, lengths, u_acc, u_draw)
    got = triton_ops.rejection_sample(target, draft_probs, drafts, lengths, u_acc, u_draw)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_and_block_copy_match_the_reference(dtype: torch.dtype) -> None:
    from deepinfer_kit.cache import triton_ops

    gen = torch.Generator().manual_seed(1)
    layers, blocks, page, heads, dim = 2, 12, 16, 8, 128
    kv = torch.randn(layers, 2, blocks, page, heads, dim, generator=gen).to(DEV, dtype)
    twin = kv.clone()
    key = torch.randn(9, heads, dim, generator=gen).to(DEV, dtype)
    value = torch.randn(9, heads, dim, generator=gen).to(DEV, dtype)
    slots = torch.randperm(blocks * page, generator=gen)[:9].to(DEV)
    cache_ref.write_kv(kv[0, 0], kv[0, 1], key, value, slots)
    triton_ops.write_kv(twin[0, 0], twin[0, 1], key, value, slots)
    assert torch.equal(kv, twin)
    src = torch.tensor([0, 3, 5], device=DEV)
    dst = torch.tensor([7, 8, 11], device=DEV)
    cache_ref.copy_blocks(kv, src, dst)
    triton_ops.copy_blocks(twin, src, dst)
    assert torch.equal(kv, twin)
