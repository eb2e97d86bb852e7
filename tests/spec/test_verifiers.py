"""DraftVerifiers: greedy and strict rejection sampling against the sampler's own target
distribution; spec-decoded sequences equal plain decoding; TESTING.md §3 regressions 15-16."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer_kit.spec.verify.rows import verify_padded

from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sample.records import SamplingBatch
from deepinfer_kit.sample.vectorized import VectorizedSampler
from deepinfer_kit.spec.verify import ref_ops
from deepinfer_kit.spec.verify.greedy import GreedyVerifier
from deepinfer_kit.spec.records import DraftProposal
from deepinfer_kit.spec.verify.ref_ops import inverse_cdf
from deepinfer_kit.spec.verify.rejection import RejectionVerifier

V = 12


def _batch(params: list[SamplingParams], seeds: list[int | None], positions: list[int],
           outputs: list[list[int]] | None = None) -> SamplingBatch:
    n = len(params)
    return SamplingBatch(
        params=params, seeds=seeds, positions=positions, prompt_token_ids=[[1, 2, 3]] * n,
        output_token_ids=list(outputs) if outputs is not None else [[] for _ in range(n)],
        eos_token_ids=[None] * n, generator=torch.Generator().manual_seed(5),
    )


def _toy_logits(context: list[int]) -> torch.Tensor:
    """A deterministic toy LM: logits from the last two tokens."""
    g = torch.Generator().manual_seed(1000 * context[-1] + 7 * context[-2])
    return torch.randn(V, generator=g) * 2.0


def _plain(params: SamplingParams, seed: int | None, prompt: list[int], steps: int) -> list[int]:
    sampler = VectorizedSampler(impl="ref")
    ctx, out = list(prompt), []
    for pos in range(steps):
        batch = _batch([params], [seed], [pos], [list(out)])
        batch.prompt_token_ids = [prompt]
        tok = int(sampler(_toy_logits(ctx)[None], batch).token_ids[0])
        ctx.append(tok)
        out.append(tok)
    return out


def _speculative(verifier: object, params: SamplingParams, seed: int | None, prompt: list[int],
                 steps: int, truth: list[int], rng: random.Random) -> list[int]:
    """Drafts mix the true continuation with random tokens; verify round by round."""
    ctx, out = list(prompt), []
    while len(out) < steps:
        gamma = rng.randint(0, 4)
        drafts = [truth[i] if i < len(truth) and rng.random() < 0.7 else rng.randrange(V)
                  for i in range(len(out), len(out) + gamma)]
        logits = torch.stack([_toy_logits(ctx + drafts[:j]) for j in range(gamma + 1)])[None]
        proposal = DraftProposal(torch.tensor([drafts], dtype=torch.int64).view(1, gamma), [gamma])
        batch = _batch([params], [seed], [len(out)], [list(out)])
        batch.prompt_token_ids = [prompt]
        res = verify_padded(verifier, proposal, [gamma], logits, batch)
        assert 0 <= res.num_accepted[0] <= gamma and len(res.token_ids[0]) == res.num_accepted[0] + 1
        assert res.token_ids[0][: res.num_accepted[0]] == drafts[: res.num_accepted[0]]
        ctx += res.token_ids[0]
        out += res.token_ids[0]
    return out[:steps]


@pytest.mark.parametrize("case", range(12))
def test_speculative_sequences_equal_plain_decoding(case: int) -> None:
    rng = random.Random(case)
    prompt = [rng.randrange(V) for _ in range(3)]
    greedy = SamplingParams(temperature=0.0, repetition_penalty=1.3 if case % 2 else 1.0)
    truth = _plain(greedy, None, prompt, 20)
    for verifier in (GreedyVerifier(), RejectionVerifier(VectorizedSampler(impl="ref"))):
        assert _speculative(verifier, greedy, None, prompt, 20, truth, rng) == truth
    # Seeded sampling with a deterministic drafter: token for token the plain draw.
    sampled = SamplingParams(temperature=0.9, top_k=6, top_p=0.9, seed=case,
                             frequency_penalty=0.5 if case % 3 else 0.0)
    truth = _plain(sampled, case, prompt, 20)
    verifier = RejectionVerifier(VectorizedSampler(impl="ref"))
    assert _speculative(verifier, sampled, case, prompt, 20, truth, rng) == truth


SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, top_k=7, top_p=0.9, min_p=0.05),
]
N = 200_000
GAMMA = 2


def _tv(samples: torch.Tensor, probs: torch.Tensor) -> float:
    emp = torch.bincount(samples, minlength=probs.shape[0]).double() / samples.shape[0]
    return 0.5 * float((emp - probs).abs().sum())


def _run_distribution(params: SamplingParams, verifier: object, seed: int) -> tuple[float, float]:
    """TV of the first and (given the first draft accepted) the second token emitted."""
    from deepinfer_kit.sample.reference import filtered_distribution

    g = torch.Generator().manual_seed(seed)
    target_rows = torch.randn(GAMMA + 1, V, generator=g) * 1.5
    # Mismatched, yet close enough that the first draft is accepted often (the second
    # token's check needs many rows that reach it).
    noise = torch.randn(GAMMA, V, generator=g)
    draft_probs = torch.softmax(target_rows[:GAMMA] + noise, dim=-1).double()
    drafts = torch.stack([torch.multinomial(draft_probs[j].float(), N, True, generator=g)
                          for j in range(GAMMA)], dim=1)
    proposal = DraftProposal(drafts, [GAMMA] * N, draft_probs.expand(N, GAMMA, V))
    batch = _batch([params] * N, [None] * N, [0] * N)
    batch.generator = torch.Generator().manual_seed(seed + 1)
    res = verify_padded(verifier, proposal, [GAMMA] * N, target_rows.expand(N, GAMMA + 1, V), batch)
    first = torch.tensor([t[0] for t in res.token_ids])
    second = torch.tensor([t[1] for t in res.token_ids if len(t) > 1])
    p0 = filtered_distribution(target_rows[0], params)
    p1 = filtered_distribution(target_rows[1], params)
    assert min(res.num_accepted) >= 0 and max(max(t) for t in res.token_ids) < V
    assert second.shape[0] >= N // 4, second.shape
    return _tv(first, p0), _tv(second, p1)


_TRUE_REJECTION = ref_ops.rejection_sample


def _biased_rejection(target, draft_probs, draft_ids, lengths, u_accept, u_draw):  # type: ignore[no-untyped-def]
    """The classic bug: on rejection, draw from p_t instead of the residual."""
    num_acc, _ = _TRUE_REJECTION(target, draft_probs, draft_ids, lengths, u_accept, u_draw)
    at = num_acc.view(-1, 1, 1).expand(-1, 1, target.shape[2])
    u = u_draw.gather(1, num_acc.unsqueeze(1)).squeeze(1)
    return num_acc, ref_ops.inverse_cdf(target.gather(1, at).squeeze(1), u)


@pytest.mark.parametrize("index", range(len(SETTINGS)))
def test_rejection_sampling_keeps_the_target_distribution(index: int) -> None:
    verifier = RejectionVerifier(VectorizedSampler(impl="ref"))
    tv0, tv1 = _run_distribution(SETTINGS[index], verifier, seed=index)
    assert tv0 <= 0.01 and tv1 <= 0.01, (tv0, tv1)


@pytest.mark.parametrize("index", range(len(SETTINGS)))
def test_a_biased_verifier_fails_the_same_test(index: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ref_ops, "rejection_sample", _biased_rejection)
    tv0, tv1 = _run_distribution(SETTINGS[index], RejectionVerifier(VectorizedSampler("ref")), index)
    assert max(tv0, tv1) > 0.01, (tv0, tv1)


def test_deterministic_drafts_keep_the_target_distribution() -> None:
    from deepinfer_kit.sample.reference import filtered_distribution

    params = SamplingParams(temperature=0.8, top_k=8)
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(2, V, generator=g)
    p0 = filtered_distribution(rows[0], params)
    draft = int(torch.argsort(p0)[-3])  # a plausible, not the likeliest, token
    proposal = DraftProposal(torch.full((N, 1), draft, dtype=torch.int64), [1] * N)
    batch = _batch([params] * N, [None] * N, [0] * N)
    res = verify_padded(RejectionVerifier(VectorizedSampler("ref")), proposal, [1] * N, rows.expand(N, 2, V), batch)
    assert _tv(torch.tensor([t[0] for t in res.token_ids]), p0) <= 0.01


def test_seeded_verification_is_reproducible_and_batch_invariant() -> None:
    params = SamplingParams(temperature=1.0, seed=11)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, GAMMA + 1, V, generator=g)
    draft_probs = torch.softmax(torch.randn(6, GAMMA, V, generator=g), dim=-1)
    drafts = torch.randint(0, V, (6, GAMMA), generator=g)
    verifier = RejectionVerifier(VectorizedSampler("ref"))

    def run(rows: list[int], seeds: list[int | None]) -> list[list[int]]:
        prop = DraftProposal(drafts[rows], [GAMMA] * len(rows), draft_probs[rows])
        batch = _batch([params] * len(rows), seeds, [4] * len(rows))
        return verify_padded(verifier, prop, [GAMMA] * len(rows), logits[rows], batch).token_ids

    alone = run([2], [11])
    assert run([0, 1, 2, 3], [5, None, 11, 7])[2] == alone[0] == run([2], [11])[0]
    assert len({tuple(run([2], [s])[0]) for s in range(20)}) > 1


def test_empty_drafts_and_no_requests() -> None:
    """Regression 15: an empty sample never makes the accepted count -1."""
    verifier = RejectionVerifier(VectorizedSampler("ref"))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1)]
    logits = torch.randn(2, 1, V)
    empty = DraftProposal(torch.zeros(2, 0, dtype=torch.int64), [0, 0])
    for v in (verifier, GreedyVerifier()):
        res = verify_padded(v, empty, [0, 0], logits, _batch(params, [None, 1], [0, 0]))
        assert res.num_accepted == [0, 0] and all(len(t) == 1 for t in res.token_ids)
    with_probs = DraftProposal(torch.zeros(2, 0, dtype=torch.int64), [0, 0], torch.zeros(2, 0, V))
    res = verify_padded(verifier, with_probs, [0, 0], logits, _batch(params, [None, 1], [0, 0]))
    assert res.num_accepted == [0, 0]
    none = DraftProposal(torch.zeros(0, 3, dtype=torch.int64), [])
    assert verify_padded(verifier, none, [], torch.zeros(0, 4, V), _batch([], [], [])).token_ids == []
    # Drafts proposed but none verified (length 0 of 3).
    some = DraftProposal(torch.tensor([[1, 2, 3]]), [3])
    res = verify_padded(verifier, some, [0], torch.randn(1, 4, V), _batch(params[:1], [None], [0]))
    assert res.num_accepted == [0] and len(res.token_ids[0]) == 1


def test_recovered_ids_stay_inside_the_vocabulary() -> None:
    """Regression 16: a tie-break or rounding at the end of the CDF never yields id >= V."""
    w = torch.tensor([[0.2, 0.3, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0], [1e-300, 0, 0, 0, 1e-300]],
                     dtype=torch.float64)
    u = torch.tensor([1.0 - 2.0**-53, 0.999, 0.9999999999], dtype=torch.float64)
    tok = inverse_cdf(w, u)
    assert tok.tolist() == [2, 0, 4]
    # The residual of equal target and draft rows is all zeros after rounding.
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(64)]
    logits = torch.randn(1, 2, V).expand(64, 2, V)
    probs = torch.softmax(logits[:, :1].double(), dim=-1)
    prop = DraftProposal(torch.randint(0, V, (64, 1)), [1] * 64, probs)
    res = verify_padded(RejectionVerifier(VectorizedSampler("ref")), prop, [1] * 64, logits,
                        _batch(params, list(range(64)), [0] * 64))
    assert all(0 <= t < V for row in res.token_ids for t in row)


def test_greedy_verification_picks_the_lowest_id_on_ties() -> None:
    logits = torch.zeros(1, 2, V)
    logits[0, 0, 3] = logits[0, 0, 5] = 1.0
    prop = DraftProposal(torch.tensor([[5]]), [1])
    batch = _batch([SamplingParams(temperature=0.0)], [None], [0])
    for v in (GreedyVerifier(), RejectionVerifier(VectorizedSampler("ref"))):
        assert verify_padded(v, prop, [1], logits, batch).token_ids == [[3]]
