"""The Engine and LLM API on the embedded tiny model: inputs, outputs, errors, aborts."""

from __future__ import annotations

import pytest

from deepinfer_kit import LLM, ConfigError, EngineConfig, SamplingParams, build_engine


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", num_blocks=256)


def test_generate_returns_outputs_in_input_order(llm: LLM) -> None:
    prompts = ["a much longer prompt than the others, to finish last", "hi", "mid length"]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (9, 2, 5)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [9, 2, 5]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert all(o.outputs[0].text == llm.engine.tokenizer.decode(o.outputs[0].token_ids) for o in outs)  # type: ignore[union-attr]
    llm.engine.check_idle()


def test_token_id_prompts_and_single_prompt_forms(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    single = llm.generate([5, 6, 7], params, use_tqdm=False)
    batch = llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
    assert len(single) == 1 and single[0].prompt_token_ids == [5, 6, 7]
    assert batch[0].outputs[0].token_ids == single[0].outputs[0].token_ids


def test_n_completions_share_the_prompt_and_differ(llm: LLM) -> None:
    params = SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=3, ignore_eos=True)
    (out,) = llm.generate(["fork me"], params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "seeded forks must not all agree"
    (again,) = llm.generate(["fork me"], params, use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    llm.engine.check_idle()


def test_seeded_request_is_batch_invariant(llm: LLM) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seed=11, ignore_eos=True)
    (alone,) = llm.generate(["the same request"], params, use_tqdm=False)
    others = [SamplingParams(temperature=1.0, max_tokens=4, seed=s) for s in range(5)]
    crowd = llm.generate(
        ["noise one", "noise two", "the same request", "noise three", "x", "y"],
        others[:2] + [params] + others[2:5],
        use_tqdm=False,
    )
    assert crowd[2].outputs[0].token_ids == alone.outputs[0].token_ids


def test_stop_token_and_min_tokens(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (ref,) = llm.generate(["stop here"], greedy, use_tqdm=False)
    tokens = ref.outputs[0].token_ids
    stop = tokens[3]
    first = tokens.index(stop)
    stopped = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop], ignore_eos=True)
    (out,) = llm.generate(["stop here"], stopped, use_tqdm=False)
    assert out.outputs[0].token_ids == tokens[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("", "prompt must not be empty"),
        ([], "prompt must not be empty"),
        ([1, 2, 100000], "prompt token ids must be ints in [0, 259), got 100000"),
        ([1, -1], "prompt token ids must be ints in [0, 259), got -1"),
        ("x" * 5000, "must be shorter than max_model_len=4096"),
    ],
)
def test_bad_prompt_is_rejected_and_engine_keeps_serving(llm: LLM, prompt: object, message: str) -> None:
    engine = llm.engine
    good = engine.add_request("good", "still served", SamplingParams(temperature=0.0, max_tokens=3))
    with pytest.raises(ConfigError) as info:
        engine.add_request("bad", prompt, SamplingParams())  # type: ignore[arg-type]
    assert message in str(info.value)
    outs = engine.run()
    assert [o.request_id for o in outs] == [good]
    engine.check_idle()


def test_bad_generate_batch_runs_nothing(llm: LLM) -> None:
    with pytest.raises(ConfigError, match="prompt must not be empty"):
        llm.generate(["fine", ""], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ConfigError, match="sampling_params must be one or one per prompt"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_duplicate_live_id_is_rejected_then_reusable(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("dup", "first", SamplingParams(max_tokens=2))
    with pytest.raises(ConfigError, match="'dup' is already in use"):
        engine.add_request("dup", "second", SamplingParams(max_tokens=2))
    engine.run()
    engine.add_request("dup", "third", SamplingParams(max_tokens=2))
    engine.run()
    engine.check_idle()


@pytest.mark.parametrize("steps_before_abort", [0, 1, 3])
def test_abort_in_any_state_frees_everything(llm: LLM, steps_before_abort: int) -> None:
    engine = llm.engine
    engine.add_request("victim", "abort me " * 8, SamplingParams(n=2, temperature=1.0, max_tokens=20, ignore_eos=True))
    engine.add_request("bystander", "keep me", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    outs = []
    for _ in range(steps_before_abort):
        outs += engine.step()
    assert engine.abort("victim")
    outs += engine.run()
    by_id = {o.request_id: o for o in outs}
    assert [c.finish_reason for c in by_id["victim"].outputs] == ["abort", "abort"]
    assert len(by_id["bystander"].outputs[0].token_ids) == 6
    assert not engine.abort("victim")
    engine.check_idle()


def test_kv_budget_too_small_names_the_largest_length() -> None:
    with pytest.raises(ConfigError, match="the largest max_model_len that fits is 64"):
        build_engine(EngineConfig(num_blocks=4, block_size=16, max_model_len=65))
    with pytest.warns(UserWarning, match="capped to 64"):  # the model's default is capped
        build_engine(EngineConfig(num_blocks=4, block_size=16))


@pytest.mark.parametrize(
    ("field", "value"),
    [("dtype", "float64"), ("block_size", 0), ("scheduler", "lottery"), ("prefix_index", "trie"), ("num_blocks", -3),
     ("device", "meta"), ("device", "bogus"), ("device", "cuda:abc"), ("device", "cuda:-1"), ("device", "mps"),
     ("device", 0), ("device", None), ("max_logprobs", -2), ("max_logprobs", 2.0), ("max_logprobs", True)],
)
def test_bad_engine_config_names_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as err:
        EngineConfig(**{field: value})  # type: ignore[arg-type]
    assert field in str(err.value) and repr(value) in str(err.value), str(err.value)


# ids without the bare word "cuda", which conftest reads as "skip without a GPU"
@pytest.mark.parametrize("device", ["cpu", "cpu:0", "cuda", "cuda:1"], ids=["cpu", "cpu0", "gpu", "gpu1"])
def test_cpu_and_cuda_device_strings_are_accepted(device: str) -> None:
    # Availability is checked when the engine is built, not in the config.
    assert EngineConfig(device=device).device == device


def test_max_logprobs_defaults_to_vllms_20() -> None:
    assert EngineConfig().max_logprobs == 20
    assert EngineConfig(max_logprobs=0).max_logprobs == 0
    assert EngineConfig(max_logprobs=-1).max_logprobs == -1  # vLLM's "no cap"


def test_unknown_checkpoint_folder_is_a_config_error(tmp_path: object) -> None:
    with pytest.raises(ConfigError):
        build_engine(model=str(tmp_path))


def test_logprobs_follow_each_token(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True)
    (out,) = llm.generate(["logprobs please"], params, use_tqdm=False)
    c = out.outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == 5
    total = 0.0
    for token, entry in zip(c.token_ids, c.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy picks the top token
        assert sorted(lp.rank for lp in entry.values()) == [1, 2, 3]  # it is among the top 3
        logprobs = [entry[t].logprob for t in sorted(entry, key=lambda t: entry[t].rank)]
        assert logprobs == sorted(logprobs, reverse=True) and logprobs[0] <= 0.0
        total += entry[token].logprob
    assert c.cumulative_logprob is not None and abs(c.cumulative_logprob - total) < 1e-4
    (plain,) = llm.generate(["logprobs please"], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None
    assert plain.outputs[0].token_ids == c.token_ids
