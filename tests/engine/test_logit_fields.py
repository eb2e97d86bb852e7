"""``logit_bias`` / ``allowed_token_ids`` / ``bad_words`` through the engine: greedy tokens
equal a transformers oracle edited per row, allowed ids are never left, a +100 bias forces
its token, bad words never complete, a row does not depend on its batch, and the overlap,
speculative and Triton-sampler paths give the plain path's tokens."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from deepinfer_kit import SamplingParams, build_engine
from deepinfer_kit.engine.engine import Engine
from deepinfer_kit.engine.requests import bad_word_sequences
from deepinfer_kit.errors import ConfigError

from hf_models import hf_logits
from logit_oracle import reference_row


def _run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    ids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
    outs = {o.request_id: o for o in engine.run()}
    engine.check_idle()
    return [outs[i].outputs[0].token_ids for i in ids]


def _oracle(model: Any, prompt: list[int], p: SamplingParams, n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(int(reference_row(hf_logits(model, prompt + out)[-1], p, out).argmax()))
    return out


def _params(rng: random.Random, vocab: int, plain: list[int], **common: Any) -> list[SamplingParams]:
    """One row per field (and all together); the bad words are pairs of the plain output,
    so they would be written without the stage."""
    pairs = [plain[i : i + 2] for i in range(0, len(plain) - 1, 2)]
    return [
        SamplingParams(**common),
        SamplingParams(logit_bias={rng.randrange(vocab): 7.5, plain[0]: -100.0}, **common),
        SamplingParams(allowed_token_ids=rng.sample(range(vocab), 5), **common),
        SamplingParams(bad_words_token_ids=[*pairs, [plain[3]]], **common),
        SamplingParams(logit_bias={plain[1]: 4.0}, allowed_token_ids=[*plain[:6], 3],
                       bad_words_token_ids=pairs[:2], **common),
    ]


@pytest.mark.parametrize("config", [{}, {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 8}])
def test_greedy_tokens_equal_the_edited_oracle(checkpoints: dict[str, tuple[Path, Any]],
                                               config: dict[str, Any]) -> None:
    folder, model = checkpoints["qwen3"]
    rng = random.Random(3)
    prompt = [rng.randrange(160) for _ in range(21)]
    greedy = {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True}
    engine = build_engine(model=str(folder), block_size=4, **config)
    plain = _run(engine, [prompt], [SamplingParams(**greedy)])[0]
    params = _params(rng, 160, plain, **greedy)
    got = _run(engine, [prompt] * len(params), params)
    want = [_oracle(model, prompt, p, 10) for p in params]
    assert got == want
    assert got[0] == plain and all(g != plain for g in got[1:])


def _sampled(rng: random.Random, vocab: int, **kw: Any) -> list[SamplingParams]:
    plain = [rng.randrange(vocab) for _ in range(12)]
    return _params(rng, vocab, plain, temperature=1.0, max_tokens=kw.pop("max_tokens", 24),
                   ignore_eos=True, seed=11, **kw)


def test_allowed_ids_bias_and_bad_words_hold_over_many_sampled_tokens() -> None:
    engine = build_engine(model="tiny")
    vocab = engine._builder.vocab_size
    allowed = [5, 17, 40, 41]
    words = [[17, 40], [41], [5, 5]]
    params = [
        SamplingParams(temperature=1.0, max_tokens=200, ignore_eos=True, allowed_token_ids=allowed),
        SamplingParams(temperature=1.5, top_p=0.9, max_tokens=60, ignore_eos=True, logit_bias={9: 100.0}),
        SamplingParams(temperature=1.0, max_tokens=200, ignore_eos=True, allowed_token_ids=allowed,
                       bad_words_token_ids=words),
    ]
    a, b, c = _run(engine, [[1, 2, 3]] * 3, params)
    assert set(a) <= set(allowed) and len(set(a)) == len(allowed)
    assert b == [9] * 60
    assert set(c) <= {5, 17, 40}
    assert all(c[i : i + 2] not in ([17, 40], [5, 5]) for i in range(len(c) - 1))
    assert vocab > 41


def test_a_seeded_row_does_not_depend_on_its_batch() -> None:
    rng = random.Random(5)
    params = _sampled(rng, 256)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 20))] for _ in params]
    together = _run(build_engine(model="tiny"), prompts, params)
    for i in (3, 4):
        others = [SamplingParams(temperature=0.7, max_tokens=30, seed=i, ignore_eos=True,
                                 allowed_token_ids=[1, 2]) for _ in range(3)]
        alone = _run(build_engine(model="tiny"), [prompts[i], *prompts[:3]], [params[i], *others])
        assert alone[0] == together[i]


@pytest.mark.parametrize("greedy", [True, False])
def test_overlap_gives_the_synchronous_tokens(greedy: bool) -> None:
    """Bad words read the in-flight token under overlap (its placeholder row)."""
    rng = random.Random(8)
    params = _sampled(rng, 256, max_tokens=20)
    if greedy:
        params = [SamplingParams(**{**_fields(p), "temperature": 0.0}) for p in params]
    prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 20))] for _ in params]
    sync = _run(build_engine(model="tiny"), prompts, params)
    assert _run(build_engine(model="tiny", overlap=True), prompts, params) == sync


def _fields(p: SamplingParams) -> dict[str, Any]:
    return {f: getattr(p, f) for f in ("max_tokens", "ignore_eos", "seed", "logit_bias",
                                       "allowed_token_ids", "bad_words_token_ids")}


@pytest.mark.parametrize("greedy", [True, False])
def test_speculative_verification_sees_the_same_edited_logits(greedy: bool) -> None:
    rng = random.Random(9)
    unit = [rng.randrange(256) for _ in range(4)]
    prompts = [(unit * 10)[: rng.randint(12, 36)] for _ in range(5)]
    base = {"temperature": 0.0 if greedy else 1.0, "max_tokens": 24, "ignore_eos": True, "seed": 4}
    plain_out = _run(build_engine(model="tiny"), prompts[:1], [SamplingParams(**base)])[0]
    params = _params(rng, 256, plain_out, **base)
    want = _run(build_engine(model="tiny"), prompts, params)
    traces: list[Any] = []
    fast = build_engine(model="tiny", speculative={"num_draft": 3}, trace=traces.append)
    assert _run(fast, prompts, params) == want
    assert sum(t.num_drafted for t in traces) > 0 and sum(t.num_accepted for t in traces) > 0


@pytest.mark.triton
def test_the_triton_sampler_draws_the_torch_samplers_tokens() -> None:
    rng = random.Random(12)
    params = _sampled(rng, 256, max_tokens=6)
    params += [SamplingParams(**{**_fields(p), "temperature": 0.8, "top_k": 20, "top_p": 0.9}) for p in params[1:]]
    prompts = [[rng.randrange(256) for _ in range(5)] for _ in params]
    torch_path = _run(build_engine(model="tiny", sampler_impl="ref"), prompts, params)
    assert _run(build_engine(model="tiny", sampler_impl="triton"), prompts, params) == torch_path


def test_add_request_checks_ids_against_the_vocabulary() -> None:
    engine = build_engine(model="tiny")
    vocab = engine._builder.vocab_size
    for bad, name in [({"logit_bias": {vocab: 1.0}}, "logit_bias"),
                      ({"allowed_token_ids": [0, vocab + 3]}, "allowed_token_ids"),
                      ({"bad_words_token_ids": [[1, vocab]]}, "bad_words_token_ids")]:
        with pytest.raises(ConfigError, match=rf"{name} must hold token ids in \[0, {vocab}\)"):
            engine.add_request(None, [1, 2], SamplingParams(**bad))
    engine.check_idle()


class _Words:
    """A word-level tokenizer with a BOS that it adds to every text, and distinct ids for a
    word with and without its leading space (as BPE vocabularies have)."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        out = [0]
        for i, part in enumerate(text.split(" ")):
            if part:
                key = (" " if i else "") + part
                out.append(self.ids.setdefault(key, len(self.ids) + 1))
        return out


def test_bad_words_are_tokenized_with_and_without_a_leading_space() -> None:
    tok = _Words()
    seqs = bad_word_sequences(tok, ["hello", " big cat"])  # type: ignore[arg-type]
    hello, s_hello = tok.ids["hello"], tok.ids[" hello"]
    big, s_big, s_cat = tok.ids["big"], tok.ids[" big"], tok.ids[" cat"]
    assert seqs == [(hello,), (s_hello,), (big, s_cat), (s_big, s_cat)]


def test_bad_words_reach_the_engine_through_its_tokenizer() -> None:
    """The tiny model's byte tokenizer: a printable output byte banned as a word (one
    token, so always banned) never appears again, and the output changes."""
    engine = build_engine(model="tiny")
    tokenizer = engine._builder.tokenizer
    assert tokenizer is not None
    prompt = tokenizer.encode("the cat")
    greedy = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    plain = _run(engine, [prompt], [SamplingParams(**greedy)])[0]
    printable = [t for t in plain if 33 <= t <= 126]
    assert printable, plain
    word = chr(printable[0])
    assert bad_word_sequences(tokenizer, [word]) == [(printable[0],)]
    got = _run(engine, [prompt], [SamplingParams(bad_words=[word], **greedy)])[0]
    assert printable[0] not in got and got != plain
    with pytest.raises(ConfigError, match="bad_words need a tokenizer"):
        engine._builder.tokenizer = None
        engine.add_request(None, prompt, SamplingParams(bad_words=["x"]))


def test_logprobs_are_those_of_the_raw_logits() -> None:
    """As vLLM's default: the bias moves the draw, not the reported logprobs."""
    engine = build_engine(model="tiny")
    base = {"temperature": 0.0, "max_tokens": 1, "ignore_eos": True, "logprobs": 3}
    ids = [engine.add_request(None, [4, 5, 6], SamplingParams(**base)),
           engine.add_request(None, [4, 5, 6], SamplingParams(logit_bias={9: 100.0}, **base))]
    outs = {o.request_id: o.outputs[0] for o in engine.run()}
    plain, biased = outs[ids[0]], outs[ids[1]]
    assert biased.token_ids == [9] and plain.token_ids != [9]
    assert plain.logprobs is not None and biased.logprobs is not None
    top = {t: lp.logprob for t, lp in plain.logprobs[0].items()}
    got = {t: lp.logprob for t, lp in biased.logprobs[0].items()}
    assert {t: got[t] for t in top} == top and got[9] < max(top.values())
