"""docs/coming_from_vllm.md, row by row: each test checks what its row states (the row's
name is in the test's name). Server rows also covered elsewhere say where."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import attrs
import pytest

from deepinfer_kit import LLM, ConfigError, DeepInferError, EngineConfig, SamplingParams
from deepinfer_kit.engine.llm import tensor_parallel_options
from deepinfer_kit.models.generation_defaults import default_device, generation_defaults
from deepinfer_kit.sample.params import RequestOutputKind

LETTERS = list(range(97, 123))  # byte tokens a..z: readable greedy text from the tiny model
EOS = 257


@pytest.fixture(scope="module")
def llm() -> Any:
    m = LLM("tiny", num_blocks=256, block_size=8, max_model_len=64)
    yield m
    m.close()


def one(llm: Any, prompt: Any = "hello", **kw: Any) -> Any:
    return llm.generate(prompt, SamplingParams(**kw))[0]


def letters(llm: Any, **kw: Any) -> Any:
    return one(llm, temperature=0, max_tokens=10, allowed_token_ids=LETTERS, **kw).outputs[0]


# ---- SamplingParams ---------------------------------------------------------------------

def test_row_n(llm: Any) -> None:
    out = one(llm, n=3, temperature=1.0, seed=1, max_tokens=4)
    assert [c.index for c in out.outputs] == [0, 1, 2]


def test_row_n_with_greedy() -> None:
    with pytest.raises(ConfigError, match="n must be 1 when using greedy"):
        SamplingParams(n=2, temperature=0)
    assert SamplingParams(n=2, top_k=1).n == 2


def test_row_best_of_and_missing_fields() -> None:
    for name in ("best_of", "logits_processors", "guided_decoding", "extra_args"):
        with pytest.raises(TypeError):
            SamplingParams(**{name: None})


def test_row_temperature() -> None:
    assert SamplingParams(temperature=0.005).temperature == 0.01
    assert SamplingParams(temperature=3.0).temperature == 3.0  # differs: vLLM refuses > 2
    with pytest.raises(ConfigError, match="temperature"):
        SamplingParams(temperature=-0.1)


def test_row_top_k(llm: Any) -> None:
    a = one(llm, top_k=0, temperature=1.0, seed=4, max_tokens=6).outputs[0].token_ids
    assert one(llm, top_k=-1, temperature=1.0, seed=4, max_tokens=6).outputs[0].token_ids == a


@pytest.mark.parametrize(("field", "bad", "good"), [
    ("top_p", 0.0, 1.0), ("top_p", 1.5, 0.5), ("min_p", -0.1, 0.0), ("min_p", 1.1, 1.0),
    ("presence_penalty", 2.5, -2.0), ("frequency_penalty", -2.1, 2.0), ("repetition_penalty", 0.0, 0.5),
])
def test_row_ranges_of_top_p_min_p_and_penalties(field: str, bad: float, good: float) -> None:
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**{field: bad})
    assert getattr(SamplingParams(**{field: good}), field) == good


def test_row_seed(llm: Any) -> None:
    p = SamplingParams(temperature=1.0, seed=9, max_tokens=6)
    alone = llm.generate("seeded", p)[0].outputs[0].token_ids
    batch = llm.generate(["x", "seeded", "yy"], [SamplingParams(temperature=1.0, max_tokens=6), p,
                                                 SamplingParams(temperature=0.7, seed=2, max_tokens=3)])
    assert batch[1].outputs[0].token_ids == alone


def test_row_stop_and_include_stop_str_in_output(llm: Any) -> None:
    text = letters(llm).text
    stop = text[4:6]
    cut = letters(llm, stop=[stop])
    assert cut.text == text[: text.index(stop)] and cut.stop_reason == stop and cut.finish_reason == "stop"
    kept = letters(llm, stop=stop, include_stop_str_in_output=True)
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_row_stop_token_ids(llm: Any) -> None:
    ids = letters(llm).token_ids
    got = letters(llm, stop_token_ids=[ids[2]])
    assert got.stop_reason == ids[2] and got.finish_reason == "stop" and got.token_ids[-1] == ids[2]


def test_row_ignore_eos_and_min_tokens(llm: Any) -> None:
    eos_first = one(llm, temperature=0, max_tokens=8, logit_bias={EOS: 100.0}).outputs[0]
    assert eos_first.finish_reason == "stop" and len(eos_first.token_ids) == 1
    ignored = one(llm, temperature=0, max_tokens=8, logit_bias={EOS: 100.0}, ignore_eos=True).outputs[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 8
    held = one(llm, temperature=0, max_tokens=8, logit_bias={EOS: 100.0}, min_tokens=3).outputs[0]
    assert EOS not in held.token_ids[:3] and held.finish_reason == "stop"


def test_row_max_tokens_none_runs_to_the_context(llm: Any) -> None:
    out = one(llm, "abcd", temperature=0, max_tokens=None, ignore_eos=True)
    assert len(out.outputs[0].token_ids) == 64 - 4 and out.outputs[0].finish_reason == "length"


def test_row_logprobs_and_prompt_logprobs(llm: Any) -> None:
    out = one(llm, "abcd", temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=1)
    c = out.outputs[0]
    assert all(tok in entry and len(entry) <= 3 for tok, entry in zip(c.token_ids, c.logprobs))
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 4
    plain = one(llm, temperature=0, max_tokens=2).outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None


def test_row_detokenize_and_skip_special_tokens(llm: Any) -> None:
    assert one(llm, temperature=0, max_tokens=3, detokenize=False).outputs[0].text == ""
    with pytest.raises(ConfigError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
    assert SamplingParams().skip_special_tokens


def test_row_spaces_between_special_tokens_has_no_effect(llm: Any) -> None:
    kw: dict[str, Any] = dict(temperature=0, max_tokens=8, skip_special_tokens=False)
    assert one(llm, spaces_between_special_tokens=False, **kw).outputs[0].text == \
        one(llm, spaces_between_special_tokens=True, **kw).outputs[0].text


def test_row_truncate_prompt_tokens(llm: Any) -> None:
    assert one(llm, "abcdef", max_tokens=1, truncate_prompt_tokens=2).prompt_token_ids == [101, 102]
    long = "x" * 100
    assert len(one(llm, long, max_tokens=1, truncate_prompt_tokens=-1).prompt_token_ids) == 63
    with pytest.raises(ConfigError, match="truncate_prompt_tokens"):
        llm.generate("abc", SamplingParams(truncate_prompt_tokens=65))


def test_row_output_kind(llm: Any) -> None:
    assert SamplingParams().output_kind is None
    engine = llm.engine
    engine.add_request("quiet", "abc", SamplingParams(max_tokens=4, ignore_eos=True))
    reports = [o for o in engine.run() if o.request_id == "quiet"]
    assert len(reports) == 1 and reports[0].finished  # Engine.step: once, finished
    outs = llm.generate("abc", SamplingParams(max_tokens=4, output_kind=RequestOutputKind.DELTA))
    assert len(outs[0].outputs[0].token_ids) == 4  # LLM.generate forces FINAL_ONLY


def test_row_output_kind_asyncllm_streams_cumulative_and_takes_dict_prompts_and_many_aborts() -> None:
    import deepinfer_kit

    async def main() -> None:
        llm = deepinfer_kit.AsyncLLM("tiny", num_blocks=64, block_size=8, max_model_len=64)
        try:
            seen = [len(o.outputs[0].token_ids) async for o in llm.generate(
                {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=5, ignore_eos=True))]
            assert seen == [1, 2, 3, 4, 5]  # CUMULATIVE by default, as vLLM's AsyncLLM
            gens = [llm.generate({"prompt": "x"}, SamplingParams(max_tokens=60, ignore_eos=True),
                                 request_id=f"r{i}") for i in range(2)]
            firsts = [await g.__anext__() for g in gens]
            assert all(not f.finished for f in firsts)
            assert await llm.abort(["r0", "r1", "never"])
            for g in gens:
                last = [o async for o in g][-1]
                assert last.outputs[0].finish_reason == "abort"
            await llm.wait_idle()
        finally:
            llm.shutdown()

    asyncio.run(main())


def test_row_logit_bias() -> None:
    with pytest.raises(ConfigError, match=r"logit_bias\[3\]"):
        SamplingParams(logit_bias={3: 150.0})
    from deepinfer_kit.serve.protocol import parse_completion

    assert parse_completion({"prompt": "x", "logit_bias": {"3": 150}}).params.logit_bias == {3: 100.0}


def test_row_allowed_token_ids_and_bad_words(llm: Any) -> None:
    out = one(llm, temperature=1.0, seed=3, max_tokens=12, allowed_token_ids=[97, 98]).outputs[0]
    assert set(out.token_ids) <= {97, 98}
    first = letters(llm).text[0]
    banned = letters(llm, bad_words=[first]).text
    assert first not in banned


def test_row_structured_outputs(llm: Any) -> None:
    pytest.importorskip("xgrammar")
    from deepinfer_kit.sample.structured import StructuredOutputError, StructuredOutputsParams

    out = one(llm, temperature=1.0, seed=3, max_tokens=20,
              structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"])).outputs[0]
    assert out.text in ("alpha", "beta") and out.finish_reason == "stop"
    with pytest.raises(StructuredOutputError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(StructuredOutputError, match="whitespace_pattern"):  # the row's difference
        one(llm, structured_outputs={"json_object": True, "whitespace_pattern": " *"})


def test_row_clone() -> None:
    p = SamplingParams(temperature=0.3, logit_bias={1: 2.0})
    q = p.clone()
    assert q == p and q is not p and q.logit_bias is not p.logit_bias


# ---- LLM ----------------------------------------------------------------------------------

def test_row_llm_model_is_a_local_folder_not_a_hub_id() -> None:
    with pytest.raises(DeepInferError):
        LLM("Qwen/Qwen3-0.6B-not-a-folder")


def test_row_generate_prompt_forms_and_order(llm: Any) -> None:
    p = SamplingParams(temperature=0, max_tokens=3)
    outs = llm.generate(["ab", [97, 98], {"prompt": "ab"}, {"prompt_token_ids": [97, 98]}], p)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    per = llm.generate(["a", "b"], [SamplingParams(max_tokens=1), SamplingParams(max_tokens=2)])
    assert [len(o.outputs[0].token_ids) for o in per] == [1, 2]


def test_row_get_default_sampling_params_and_generation_config(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_new_tokens": 7, "do_sample": True}))
    llm = LLM("tiny", generation_config=str(tmp_path), num_blocks=64, block_size=8, max_model_len=64)
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_k, d.top_p, d.max_tokens) == (0.6, 20, 0.95, 7)
    assert len(llm.generate("abc")[0].outputs[0].token_ids) <= 7
    assert LLM("tiny", generation_config="vllm", engine=llm.engine).get_default_sampling_params() == SamplingParams()
    assert generation_defaults(str(tmp_path), "auto")["max_tokens"] == 7
    assert generation_defaults(str(tmp_path), "vllm") == {}
    with pytest.raises(ConfigError, match="generation_config"):
        generation_defaults("tiny", str(tmp_path / "missing"))
    llm.close()


def test_row_dtype_and_device_defaults(tmp_path: Path) -> None:
    import torch

    from deepinfer_kit._dtypes import auto_dtype
    from deepinfer_kit.engine.runner.pool import model_dtype

    assert auto_dtype("float32", "cuda") == "bfloat16" and auto_dtype(None, "cuda") == "bfloat16"
    assert auto_dtype("float16", "cuda") == "float16" and auto_dtype("bf16", "cuda") == "bfloat16"
    assert auto_dtype("float16", "cpu") == "float16" and auto_dtype("float32", "cpu") == "float32"
    assert auto_dtype(None, "cpu") == "float32"
    with pytest.raises(ConfigError, match="'int8'"):
        auto_dtype("int8", "cuda")
    # The bare config, LLM and the command line share one default and one rule.
    assert attrs.fields(EngineConfig).dtype.default == "auto"
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for model in ("tiny", "tiny-words"):  # the embedded models: float32 everywhere
        assert model_dtype(EngineConfig(model=model), cuda) == torch.float32
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    assert default_device("tiny") == "cpu"
    assert default_device(str(tmp_path)) == ("cuda" if torch.cuda.is_available() else "cpu")


def test_row_engine_args_enforce_eager_and_tensor_parallel_size() -> None:
    llm = LLM("tiny", seed=1, block_size=8, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64,
              enable_prefix_caching=False, max_logprobs=5, enforce_eager=True, tensor_parallel_size=1,
              num_blocks=32)
    cfg = llm.engine.scheduler.config  # type: ignore[attr-defined]
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len) == (4, 64, 64)
    twice = [llm.generate("a prompt of some length", SamplingParams(max_tokens=1))[0] for _ in range(2)]
    assert twice[1].num_cached_tokens == 0  # enable_prefix_caching=False
    llm.close()
    # tensor_parallel_size alone starts one worker process per rank, as vLLM's LLM does
    assert tensor_parallel_options(2) == {"tensor_parallel": 2, "worker": "process"}
    assert tensor_parallel_options(2, "launched") == {"tensor_parallel": 2}
    assert tensor_parallel_options(1) == {"tensor_parallel": 1}
    with pytest.raises(ConfigError, match="tensor_parallel_size must be an int >= 1"):
        tensor_parallel_options(0)
    with pytest.raises(ConfigError, match="enforce_eager"):
        LLM("tiny", enforce_eager="yes")


def test_row_speculative_config_and_missing_options() -> None:
    for name in ("speculative_config", "trust_remote_code", "quantization", "revision"):
        with pytest.raises(ConfigError, match=name):
            LLM("tiny", **{name: None})


def test_row_kv_sizing_default() -> None:
    assert attrs.fields(EngineConfig).gpu_memory_utilization.default == 0.9  # vLLM's: 0.92


def test_row_max_model_len_too_large_for_the_pool() -> None:
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM("tiny", num_blocks=4, block_size=8, max_model_len=1000)


def test_row_chat_get_tokenizer_and_absent_methods(llm: Any) -> None:
    from served_app import CHATML

    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2), chat_template=CHATML)
    assert out[0].prompt.startswith("<|im_start|>user\nhi")
    tok = llm.get_tokenizer()
    assert tok.decode(tok.encode("héllo")) == "héllo"
    assert not any(hasattr(llm, m) for m in ("beam_search", "encode", "embed", "score"))


# ---- RequestOutput, CompletionOutput ------------------------------------------------------

def test_rows_request_output_and_completion_output(llm: Any) -> None:
    a = one(llm, "the same prompt here", temperature=0, max_tokens=2)
    b = one(llm, "the same prompt here", temperature=0, max_tokens=2)
    assert a.prompt == "the same prompt here" and a.finished and a.outputs[0].index == 0
    assert b.num_cached_tokens > 0 and a.metrics.first_token_time is not None
    assert a.outputs[0].finish_reason == "length" and a.outputs[0].stop_reason is None
    for absent in ("lora_request", "encoder_prompt", "multi_modal_placeholders"):
        assert not hasattr(a, absent)
    assert a.kv_transfer_params is None  # set by a prefill server only (tests/serve/test_pd_serve.py)
    assert not hasattr(a.outputs[0], "lora_request")


# ---- command line and server --------------------------------------------------------------

def test_row_serve_positional_model_and_vllm_flags() -> None:
    from deepinfer_kit.cli import build_parser

    args = build_parser().parse_args([
        "serve", "/models/m", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
        "--no-enable-prefix-caching", "--enforce-eager", "--tensor-parallel-size", "1", "--seed", "3",
        "--generation-config", "vllm", "--api-key", "k", "--trust-request-chat-template"])
    assert args.model_tag == "/models/m" and args.max_num_seqs == 8 and args.max_num_batched_tokens == 512
    assert args.enable_prefix_caching is False and args.enforce_eager and args.engine_seed == 3
    assert args.generation_config == "vllm" and args.api_key == "k" and args.trust_request_chat_template
    gen = build_parser().parse_args(["generate", "--max-num-seqs", "2", "--enforce-eager"])
    from deepinfer_kit.cli_engine import engine_config

    cfg = engine_config(gen)
    assert cfg.max_num_seqs == 2 and not cfg.cuda_graphs and cfg.device == "cpu"


def test_row_unknown_fields_are_logged_as_ignored(caplog: pytest.LogCaptureFixture) -> None:
    from deepinfer_kit.serve.protocol import parse_completion

    with caplog.at_level(logging.WARNING, logger="deepinfer_kit.serve"):
        parse_completion({"prompt": "x", "frobnicate": 1})
    assert any("frobnicate" in m and "ignored" in m for m in caplog.messages)


def test_row_server_rows_are_tested_where_named() -> None:
    """The remaining server rows (api key, request templates, SSE, /v1/models, /health,
    /version, /tokenize, /detokenize, /metrics, body fields, max_tokens beyond the context,
    param on every refusal, caps, limits, refused fields, fairness, disconnects) are
    checked in the files named here; this test fails if one of them is gone."""
    here = Path(__file__).parent
    sources = {name: (here / name).read_text() for name in ("test_hostile.py", "test_observe.py",
                                                            "test_server.py", "test_structured_serve.py")}
    wanted = {
        "test_hostile.py": ["test_the_api_key_is_required", "test_request_chat_templates_are_refused",
                            "test_over_the_cap_and_refused_fields", "test_a_text_plain_post",
                            "test_a_small_request_is_answered_while_n_equals_max_num_seqs_runs"],
        "test_observe.py": ["test_metrics_parse", "test_health_version_and_models",
                            "test_tokenize_and_detokenize", "test_sampling_fields_in_the_body_are_honoured"],
        "test_server.py": ["test_raw_sse_ends_with_done", "test_a_client_that_disconnects_mid_stream",
                           "test_bad_requests_get_400_naming_the_field"],
        "test_structured_serve.py": ["test_completions_follow_a_regex", "test_chat_response_format",
                                     "test_a_streamed_answer_follows_its_choice"],
    }
    for name, tests in wanted.items():
        for t in tests:
            assert f"def {t}" in sources[name], (name, t)
