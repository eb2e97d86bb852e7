"""Text in the engine: stop strings (synchronous, overlapped, speculative, n > 1) against a
brute-force reference over the same tokens, and vLLM's max_tokens=None, n > 1 with greedy
sampling and truncate_prompt_tokens."""

from __future__ import annotations

import random
from typing import Any

import attrs
import pytest

from deepinfer_kit import LLM, RequestOutputKind, SamplingParams, build_engine
from deepinfer_kit.engine.engine import Engine
from deepinfer_kit.engine.requests import RequestBuilder
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.engine.trace import StepTrace
from deepinfer_kit.models.tokenizer import ByteTokenizer
from deepinfer_kit.outputs import RequestOutput

from text_reference import stop_reference

PROMPTS = ["Hello there", "abcabcabcabcabc", "é€ü and more", "xyzxyzxyzxyz", "0101010101"]
MODES: dict[str, dict[str, Any]] = {
    "sync": {},
    "overlap": {"overlap": True},
    "spec": {"speculative": {"drafter": "ngram", "num_draft": 4}},
}
TOK = ByteTokenizer()


def _run(engine: Engine, params: list[SamplingParams]) -> dict[str, RequestOutput]:
    for i, (prompt, sp) in enumerate(zip(PROMPTS, params)):
        engine.add_request(f"r{i}", prompt, sp)
    outs = {o.request_id: o for o in engine.run()}
    engine.check_idle()
    return outs


def _pick_stop(text: str, rng: random.Random) -> str:
    """A 1-4 character piece of ``text``, with no replacement character when it has one."""
    for size in (4, 2, 1):
        starts = [i for i in range(len(text) - size + 1) if "\ufffd" not in text[i:i + size]]
        if starts:
            start = rng.choice(starts)
            return text[start:start + rng.randint(1, size)]
    return text[: rng.randint(1, 3)]


def _inside_runs(traces: list[StepTrace], sid: str) -> set[int]:
    """Output positions of ``sid`` that were accepted drafts followed by more tokens of
    the same verified run."""
    inside, pos = set(), 0
    for t in traces:
        for c in t.chunks:
            if c.request_id == sid and c.sampled:
                inside.update(range(pos, pos + len(c.sampled) - 1))
                pos += len(c.sampled)
    return inside


def _stop_inside_a_run(tokens: list[int], inside: set[int]) -> str | None:
    """A stop string whose first occurrence is completed by a token inside a verified run."""
    for p in sorted(inside):
        tail = TOK.decode(tokens[: p + 1])[-3:]
        if len(tail) == 3 and "\ufffd" not in tail and stop_reference(TOK, tokens, [tail], 0, False)[0] == p + 1:
            return tail
    return None


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("n", [1, 3])
def test_stop_strings_end_each_completion_where_a_full_decode_finds_them(mode: str, n: int) -> None:
    config = MODES[mode]
    max_tokens = 40 if mode == "spec" else 24  # long enough for a stop inside a verified run
    base = SamplingParams(temperature=0.8 if n > 1 else 0.0, seed=11, n=n, max_tokens=max_tokens,
                          ignore_eos=True)
    ref_traces: list[StepTrace] = []
    ref_engine = build_engine(**config, trace=ref_traces.append)
    ref = _run(ref_engine, [base] * len(PROMPTS))
    rng = random.Random(f"{mode}{n}")
    params, expected, planted = [], [], 0
    for i in range(len(PROMPTS)):
        tokens = [c.token_ids for c in ref[f"r{i}"].outputs]
        stops = [_pick_stop(TOK.decode(tokens[j]), rng) for j in {0, n - 1}]
        inside = _stop_inside_a_run(tokens[0], _inside_runs(ref_traces, f"r{i}"))
        if inside is not None:  # speculative: a stop that drops the rest of a verified run
            stops, planted = [inside], planted + 1
        include = i % 2 == 1
        params.append(SamplingParams(
            temperature=base.temperature, seed=11, n=n, max_tokens=max_tokens, ignore_eos=True,
            stop=stops, include_stop_str_in_output=include,
        ))
        expected.append([stop_reference(TOK, t, stops, 0, include) for t in tokens])
    got = _run(build_engine(**config), params)
    for i, want in enumerate(expected):
        for c, (kept, stop, text) in zip(got[f"r{i}"].outputs, want):
            ref_tokens = ref[f"r{i}"].outputs[c.index].token_ids
            assert c.token_ids == ref_tokens[:kept], (i, c.index)
            assert (c.text, c.stop_reason) == (text, stop), (i, c.index)
            assert c.finish_reason == ("stop" if stop else "length")
    if mode == "spec" and n == 1:  # greedy drafts of repetitive prompts get accepted
        assert planted > 0


def test_max_tokens_none_runs_until_the_context_is_full() -> None:
    engine = build_engine(max_model_len=48)
    engine.add_request("a", "0123456789", SamplingParams(max_tokens=None, ignore_eos=True))
    (out,) = engine.run()
    assert len(out.outputs[0].token_ids) == 48 - 10 and out.outputs[0].finish_reason == "length"
    engine.check_idle()


def test_n_greedy_gives_identical_completions() -> None:
    # temperature=0 with n > 1 is refused (as vLLM does); top_k=1 is greedy and allowed
    (out,) = LLM("tiny").generate("same", SamplingParams(n=3, top_k=1, max_tokens=12))
    first = out.outputs[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all((c.token_ids, c.text) == (first.token_ids, first.text) for c in out.outputs)


def test_truncate_prompt_tokens_keeps_the_prompt_end() -> None:
    llm = LLM("tiny")
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    (cut,) = llm.generate("a long prompt", SamplingParams(temperature=0.0, max_tokens=8,
                                                          truncate_prompt_tokens=6))
    (short,) = llm.generate("prompt", greedy)
    assert cut.prompt_token_ids == list(b"prompt") and cut.prompt == "a long prompt"
    assert cut.outputs[0].token_ids == short.outputs[0].token_ids


def test_truncate_prompt_tokens_minus_one_keeps_what_max_model_len_allows() -> None:
    engine = build_engine(model="tiny", max_model_len=32)
    prompt = [random.Random(3).randrange(1, 200) for _ in range(50)]
    greedy = {"temperature": 0.0, "max_tokens": 4}
    cut = engine.add_request(None, prompt, SamplingParams(truncate_prompt_tokens=-1, **greedy))
    tail = engine.add_request(None, prompt[-31:], SamplingParams(**greedy))
    outs = {o.request_id: o for o in engine.run()}
    assert outs[cut].prompt_token_ids == prompt[-31:]  # max_model_len - 1: room for one output
    assert outs[cut].outputs[0].token_ids == outs[tail].outputs[0].token_ids
    assert len(outs[cut].outputs[0].token_ids) == 1  # the context is then full
    with pytest.raises(ConfigError, match=r"truncate_prompt_tokens must be <= max_model_len \(32\) "
                                          r"or -1, got 33"):
        engine.add_request(None, prompt, SamplingParams(truncate_prompt_tokens=33))
    engine.check_idle()
    bare = RequestBuilder(None, 300, None, (), 20, lambda r: None)  # no max_model_len known
    with pytest.raises(ConfigError, match="truncate_prompt_tokens=-1 needs the engine's max_model_len"):
        bare.build("r", [1, 2], SamplingParams(truncate_prompt_tokens=-1), 0, None)
    assert bare.build("r", [1, 2, 3], SamplingParams(truncate_prompt_tokens=2), 0, None).prompt_token_ids == [2, 3]


def test_generate_reports_final_outputs_whatever_the_output_kind() -> None:
    llm = LLM("tiny")
    sp = SamplingParams(temperature=0.0, max_tokens=10, stop="zz")
    final = llm.generate(["one", "two"], sp)
    delta = llm.generate(["one", "two"], SamplingParams(
        temperature=0.0, max_tokens=10, stop="zz", output_kind=RequestOutputKind.DELTA))
    assert [(o.outputs[0].text, o.outputs[0].token_ids, o.finished) for o in delta] == [
        (o.outputs[0].text, o.outputs[0].token_ids, True) for o in final
    ]


def test_detokenize_false_gives_token_ids_only() -> None:
    (out,) = LLM("tiny").generate("hi", SamplingParams(max_tokens=6, detokenize=False, logprobs=1))
    c = out.outputs[0]
    assert c.text == "" and len(c.token_ids) == 6
    assert c.logprobs is not None and all(
        lp.decoded_token is None for d in c.logprobs for lp in d.values())


def test_logprobs_carry_decoded_tokens() -> None:
    (out,) = LLM("tiny").generate("hi", SamplingParams(max_tokens=6, logprobs=2, seed=3))
    c = out.outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == 6
    for token, entry in zip(c.token_ids, c.logprobs):
        assert len(entry) >= 2
        for tid, lp in entry.items():
            assert lp.decoded_token == TOK.decode([tid], skip_special_tokens=False)
        assert token in entry


def test_skip_special_tokens_false_names_them_in_the_text() -> None:
    llm = LLM("tiny")
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    (skipped,) = llm.generate("Hello there", sp)
    (named,) = llm.generate("Hello there", attrs.evolve(sp, skip_special_tokens=False))
    ids = skipped.outputs[0].token_ids
    assert TOK.PAD in ids  # the tiny model's greedy continuation holds a special token
    assert skipped.outputs[0].text == TOK.decode(ids)
    assert named.outputs[0].text == TOK.decode(ids, skip_special_tokens=False)
    assert "<pad>" in named.outputs[0].text


def test_spaces_between_special_tokens_is_accepted_and_leaves_the_text_as_decoded() -> None:
    assert SamplingParams().spaces_between_special_tokens is True
    engine = build_engine(model="tiny")
    prompt = [*TOK.encode("ab"), TOK.EOS, TOK.BOS]
    texts = {}
    for spaces in (True, False):
        rid = engine.add_request(None, prompt, SamplingParams(
            temperature=0.0, max_tokens=12, ignore_eos=True, skip_special_tokens=False,
            spaces_between_special_tokens=spaces))
        (out,) = engine.run()
        assert out.request_id == rid
        texts[spaces] = out.outputs[0].text
        assert texts[spaces] == TOK.decode(out.outputs[0].token_ids, skip_special_tokens=False)
    assert texts[True] == texts[False]
    engine.check_idle()
