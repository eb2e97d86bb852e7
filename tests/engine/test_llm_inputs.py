"""LLM.generate inputs: every prompt form vLLM accepts, and a rejected batch that queues nothing."""

from __future__ import annotations

from typing import Any

import pytest

from deepinfer_kit import LLM, ConfigError, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", num_blocks=256)


def _still_serves(llm: LLM) -> None:
    """Nothing of a rejected call is left: the engine is idle and the next call gets only
    its own outputs."""
    llm.engine.check_idle()
    outs = llm.generate(["next call"], GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == ["next call"]
    assert len(outs[0].outputs[0].token_ids) == 3
    llm.engine.check_idle()


@pytest.mark.parametrize(
    ("prompts", "params", "message"),
    [
        (["a", "b"], [SamplingParams(), "oops"], "sampling_params[1] must be SamplingParams, got str"),
        (["a", "b"], [SamplingParams(), None], "sampling_params[1] must be SamplingParams, got NoneType"),
        (["a", "b"], "oops", "sampling_params must be SamplingParams or a list of them, got str"),
        (["a", "b"], {"max_tokens": 3}, "sampling_params must be SamplingParams or a list of them, got dict"),
        (["fine", ""], None, "prompt must not be empty"),
        (["fine", "x" * 5000], None, "must be shorter than max_model_len=4096"),
        (["fine", [1, 2, 100000]], None, "got 100000"),
        (["fine", {"prompt_token_ids": []}], None, "prompt must not be empty"),
        (["fine", 3.5], None, "prompts[1] must be"),
        (["fine", "fine"], [SamplingParams(), SamplingParams(n=129, temperature=1.0)], "max_num_seqs"),
        (["fine", "fine"], [SamplingParams(), SamplingParams(logprobs=21)], "max_logprobs (20)"),
    ],
)
def test_rejected_batch_queues_nothing(llm: LLM, prompts: Any, params: Any, message: str) -> None:
    queued_tokens = llm.engine.num_prompt_tokens  # grows with every request add_request queues
    with pytest.raises(ConfigError) as err:
        llm.generate(prompts, params, use_tqdm=False)
    assert message in str(err.value)
    assert llm.engine.num_prompt_tokens == queued_tokens, "part of the batch was queued"
    _still_serves(llm)


def test_add_request_failing_midway_aborts_what_this_call_queued(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = llm.engine.add_request
    calls: list[str] = []

    def flaky(request_id: Any, prompt: Any, params: Any = None, **kw: Any) -> str:
        if len(calls) == 2:
            raise RuntimeError("the scheduler broke")
        rid = real(request_id, prompt, params, **kw)
        calls.append(rid)
        return rid

    monkeypatch.setattr(llm.engine, "add_request", flaky)
    with pytest.raises(RuntimeError, match="the scheduler broke"):
        llm.generate(["one", "two", "three", "four"], GREEDY, use_tqdm=False)
    assert len(calls) == 2
    monkeypatch.undo()
    _still_serves(llm)


def test_prompt_dicts_are_the_text_or_ids_they_hold(llm: LLM) -> None:
    (by_ids,) = llm.generate({"prompt_token_ids": [1, 2, 3]}, GREEDY, use_tqdm=False)
    assert by_ids.prompt is None and by_ids.prompt_token_ids == [1, 2, 3]
    (plain_ids,) = llm.generate([1, 2, 3], GREEDY, use_tqdm=False)
    assert by_ids.outputs[0].token_ids == plain_ids.outputs[0].token_ids

    (by_text,) = llm.generate({"prompt": "hello"}, GREEDY, use_tqdm=False)
    (plain_text,) = llm.generate("hello", GREEDY, use_tqdm=False)
    assert by_text.prompt == "hello" and by_text.prompt_token_ids == list(b"hello")
    assert by_text.outputs[0].token_ids == plain_text.outputs[0].token_ids

    mixed = llm.generate(
        [{"prompt": "hello"}, "hello", {"prompt_token_ids": (1, 2, 3)}, [1, 2, 3]], GREEDY, use_tqdm=False
    )
    assert [o.prompt for o in mixed] == ["hello", "hello", None, None]
    assert [o.outputs[0].token_ids for o in mixed] == [plain_text.outputs[0].token_ids] * 2 + [
        plain_ids.outputs[0].token_ids
    ] * 2
    llm.engine.check_idle()


@pytest.mark.parametrize(
    ("prompts", "where", "what"),
    [
        (None, "prompts", "NoneType"),
        (b"ab", "prompts", "bytes"),
        (bytearray(b"ab"), "prompts", "bytearray"),
        (1.5, "prompts", "float"),
        (7, "prompts", "int"),
        ({}, "prompts", "neither"),
        ({"prompt": "a", "prompt_token_ids": [1]}, "prompts", "both"),
        ({"text": "a"}, "prompts", "'text'"),
        ({"prompt": 3}, "prompts", "int"),
        ({"prompt_token_ids": "abc"}, "prompts", "str"),
        ({"prompt_token_ids": [1, 2.0]}, "prompts", "float"),
        (["ok", None], "prompts[1]", "NoneType"),
        (["ok", b"ab"], "prompts[1]", "bytes"),
        ([1.5], "prompts[0]", "float"),
        ([1, "a"], "prompts[0]", "int"),
        ([[1, [2]]], "prompts[0]", "list"),
        ([["a", "b"]], "prompts[0]", "str"),
        (["ok", {"prompt_token_ids": [1, "x"]}], "prompts[1]", "str"),
        (["ok", {"prompt": "a", "prompt_token_ids": [1]}], "prompts[1]", "both"),
        (["ok", {}], "prompts[1]", "neither"),
        ([True, False], "prompts[0]", "bool"),
    ],
)
def test_bad_prompt_types_name_the_index_and_the_type(llm: LLM, prompts: Any, where: str, what: str) -> None:
    with pytest.raises(ConfigError) as err:
        llm.generate(prompts, GREEDY, use_tqdm=False)
    message = str(err.value)
    assert message.startswith((where + " ", where + "['")), message
    assert what in message, message
    _still_serves(llm)


def test_unknown_llm_option_is_named_with_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as err:
        LLM(bogus=1)
    message = str(err.value)
    assert "'bogus'" in message
    for valid in ("num_blocks", "device", "dtype", "kv_cache_memory_mb"):
        assert valid in message, message


def test_enforce_eager_is_vllms_name_for_no_cuda_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    import deepinfer_kit.engine.llm as llm_module

    built: list[Any] = []
    real = llm_module.build_engine
    monkeypatch.setattr(llm_module, "build_engine", lambda config, **kw: built.append(config) or real(config, **kw))
    LLM(num_blocks=256, enforce_eager=True)
    LLM(num_blocks=256)
    assert [c.cuda_graphs for c in built] == [False, True]
    with pytest.raises(ConfigError, match="enforce_eager must be a bool, got 'yes'"):
        LLM(num_blocks=256, enforce_eager="yes")


def test_lone_surrogates_are_a_config_error_naming_the_prompt() -> None:
    llm = LLM("tiny", num_blocks=32, max_model_len=256)
    for prompts, where in (("a\ud800", "prompts"), (["ok", {"prompt": "\udfff"}], "prompts[1]['prompt']")):
        with pytest.raises(ConfigError, match=rf"{where.replace('[', '.').replace(']', '.')} holds a lone surrogate"):
            llm.generate(prompts, SamplingParams(max_tokens=1))
    with pytest.raises(ConfigError, match="messages holds a lone surrogate"):
        llm.chat([{"role": "user", "content": "\ud83d"}], SamplingParams(max_tokens=1),
                 chat_template="{{ messages[0]['content'] }}")
    assert llm.generate("fine", SamplingParams(max_tokens=1))[0].outputs[0].token_ids  # still serving
