"""The deepinfer-kit command: generate and trace on the embedded model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import save_file

from deepinfer_kit.cli import main
from deepinfer_kit.models.config import ModelConfig
from deepinfer_kit.models.tiny import tiny_hf_config, tiny_hf_weights


def test_generate_prints_generations_and_a_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--prompt", "hello", "--prompt", "world", "--max-tokens", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[req-0] 'hello' -> ") and "(5 tokens, length)" in out[0]
    assert out[1].startswith("[req-1] 'world' -> ")
    assert out[-1].startswith("requests=2 output_tokens=10 ")
    assert "tokens/s=" in out[-1] and "prefix_hit_rate=" in out[-1]


def test_no_arguments_runs_the_default_generation(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("requests=4 output_tokens=256 ")


def test_trace_follows_one_request(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["trace", "--prompt", "first prompt", "--prompt", "second", "--request", "1", "--max-tokens", "3"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "following req-1: 'second'" in out
    assert "prefill positions [0, 6)" in out
    assert out.count("decode  positions") == 2
    assert "finished: req-1" in out


def test_trace_shows_drafted_and_accepted_tokens_with_speculation(
    capsys: pytest.CaptureFixture[str],
) -> None:
    prompt = "abc" * 8
    args = ["trace", "--num-draft", "4", "--prompt", prompt, "--max-tokens", "16"]
    assert main(args) == 0
    spec_out = capsys.readouterr().out
    assert "drafted=" in spec_out and "accepted=" in spec_out
    assert main(["trace", "--prompt", prompt, "--max-tokens", "16"]) == 0
    plain_out = capsys.readouterr().out
    assert "drafted=" not in plain_out

    def sampled(out: str) -> list[str]:
        return [t for line in out.splitlines() if "sampled=[" in line
                for t in line.split("sampled=[")[1].split("]")[0].split(", ") if t]

    assert sampled(spec_out) == sampled(plain_out)  # greedy: the same tokens either way


@pytest.mark.parametrize("flags", [["--drafter", "self", "--draft-layers", "1"],
                                   ["--drafter", "draft_model", "--draft-model", "tiny"]])
def test_trace_with_a_model_drafter(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    prompt = "abc" * 8
    assert main(["trace", "--num-draft", "3", *flags, "--prompt", prompt, "--max-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert "drafted=" in out and "accepted=" in out


def test_a_model_drafter_without_its_field_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--num-draft", "3", "--drafter", "self"]) == 2
    assert "speculative.draft_layers" in capsys.readouterr().err


def test_bad_input_exits_2_with_the_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--max-tokens", "0"]) == 2
    assert "max_tokens must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("device", ["meta", "bogus", "cuda:abc"])
def test_bad_device_exits_2_naming_it(device: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--device", device, "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: device ") and repr(device) in err and "Traceback" not in err, err


@pytest.mark.parametrize("how", ["truncated", "garbage-header"])
def test_corrupt_checkpoint_exits_2_naming_the_file(
    how: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tiny_hf_config()
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = tiny_hf_weights(ModelConfig.from_hf_config(config), seed=0)
    file = tmp_path / "model.safetensors"
    save_file(weights, str(file))
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if how == "truncated" else b"\xff" * 64 + data[64:])
    assert main(["generate", "--model", str(tmp_path), "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(file) in err and "Traceback" not in err, err


def test_trace_of_a_missing_prompt_index_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "--prompt", "only one", "--request", "1", "--max-tokens", "2"]) == 2
    assert capsys.readouterr().err == "error: --request must be in [0, 1), got 1\n"


def test_trace_html_and_json_hold_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from deepinfer_kit.viewer import loads, read_html

    html, doc_path = tmp_path / "run.html", tmp_path / "run.json"
    args = ["trace", "--model", "tiny", "--html", str(html), "--json", str(doc_path), "--n", "2",
            "--temperature", "0.8", "--seed", "1", "--max-tokens", "6", "--prompt", "shared prefix one", "--prompt", "shared prefix two"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"to {html}" in out and f"to {doc_path}" in out
    doc = read_html(html)
    assert doc == loads(doc_path.read_text("utf-8"))
    assert doc["meta"]["num_blocks"] == 48 and doc["meta"]["model"] == "tiny"
    assert set(doc["requests"]) == {"req-0", "req-0#1", "req-1", "req-1#1"}
    draws = [d for s in doc["steps"] for d in s["sampling"]]
    assert len(draws) == 4 * 6 and all(len(d["candidates"]) >= 5 for d in draws)  # --logprobs 5
    assert main(["trace", "--prompt", "x", "--max-tokens", "2", "--scheduler", "static"]) == 0


def test_options_without_a_subcommand_mean_generate(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "tiny", "--prompt", "hi", "--max-tokens", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[req-0] 'hi' -> ") and "(3 tokens, length)" in out[0]


def test_vllm_sampling_flags(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--prompt", "Hello there", "--max-tokens", "20", "--n", "2", "--temperature", "0.8",
            "--seed", "3", "--min-p", "0.05", "--logprobs", "1", "--ignore-eos"]
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[req-0] ") and out[1].startswith("[req-0#1] ")
    assert all("(20 tokens, length, logprob -" in line for line in out[:2])
    assert out[-1].startswith("requests=1 output_tokens=40 ")


def test_stop_flag_cuts_the_text(capsys: pytest.CaptureFixture[str]) -> None:
    tiny = ["--model", "tiny", "--prompt", "Hello there", "--max-tokens", "20"]
    assert main([*tiny, "--ignore-eos"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "\\x05!" in first  # the tiny model's greedy continuation holds it
    assert main([*tiny, "--stop", "\x05!"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.endswith("-> '0' (3 tokens, stop '\\x05!')"), line


def test_context_and_memory_flags_reach_the_engine(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--prompt", "0123456789", "--max-model-len", "16", "--max-tokens", "50",
                 "--ignore-eos", "--kv-cache-memory-mb", "1"]) == 0
    assert "(6 tokens, length)" in capsys.readouterr().out
    assert main(["--kv-cache-memory-mb", "0"]) == 2
    assert "kv_cache_memory_mb" in capsys.readouterr().err


def test_serve_options_reach_the_engine_config() -> None:
    from deepinfer_kit.cli import build_parser, engine_config

    args = build_parser().parse_args(["serve", "--port", "9001", "--gpu-memory-utilization", "0.5",
                                      "--dtype", "auto", "--max-model-len", "128"])
    config = engine_config(args)
    assert (args.host, args.port) == ("127.0.0.1", 9001)
    assert (config.gpu_memory_utilization, config.dtype, config.max_model_len) == (0.5, "auto", 128)


def test_whole_vocabulary_logprobs_need_max_logprobs(capsys: pytest.CaptureFixture[str]) -> None:
    tiny = ["--model", "tiny", "--prompt", "Hi", "--max-tokens", "2", "--logprobs", "-1"]
    assert main(tiny) == 2  # the default cap (20) refuses the whole vocabulary
    assert "logprobs" in capsys.readouterr().err
    assert main([*tiny, "--max-logprobs", "-1"]) == 0
    assert "(2 tokens, length, logprob -" in capsys.readouterr().out


def test_generate_over_expert_parallel_ranks_matches_one_process(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["generate", "--prompt", "experts apart", "--max-tokens", "6", "--temperature", "0"]
    assert main(args) == 0
    alone = capsys.readouterr().out.splitlines()[0]
    assert main([*args, "--worker", "process", "--expert-parallel", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == alone
    # more than one rank starts its worker processes without --worker process
    assert main([*args, "--expert-parallel", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == alone
    assert main([*args, "--expert-parallel", "2", "--device", "cuda"]) == 2  # CPU ranks only


def test_components_come_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    """``--component KIND=module:callable`` on generate, trace and sim (tests/own_components.py
    is importable: tests/ is on the path)."""
    base = ["generate", "--model", "tiny", "--prompt", "hello", "--max-tokens", "6"]
    assert main(base) == 0
    plain = capsys.readouterr().out.splitlines()[0]
    assert main([*base, "--component", "sampler=own_components:make_sampler"]) == 0
    assert capsys.readouterr().out.splitlines()[0] != plain  # the second-best sampler drew them
    assert main(["trace", "--model", "tiny", "--prompt", "a b a b a b", "--max-tokens", "6", "--num-draft", "3",
                 "--component", "drafter=own_components:make_drafter",
                 "--component", "draft_verifier=own_components:make_verifier"]) == 0
    assert "drafted=3 accepted=3" in capsys.readouterr().out  # the accept-all verifier kept every draft
    sim = ["sim", "--num-requests", "60", "--set", 'speculative={"num_draft": 2}',
           "--component", "drafter=own_components:make_drafter",
           "--component", "eviction_policy=own_components:make_mru",
           "--component", "cost_model=own_components:make_cost"]
    assert main(sim) == 0
    assert "60" in capsys.readouterr().out
    assert main(["sim", "--num-requests", "5", "--component", "drafter=nowhere:make"]) == 2
    assert "cannot import 'nowhere'" in capsys.readouterr().err
    assert main(["generate", "--component", "wizard=own_components:make_drafter"]) == 2
    assert "KIND one of" in capsys.readouterr().err


def test_kv_tiers_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiers = json.dumps({"host_blocks": 8, "disk_blocks": 16, "disk_path": str(tmp_path), "hash_key": "ab" * 16})
    assert main(["generate", "--kv-tiers", tiers, "--prompt", "hello " * 20, "--max-tokens", "3"]) == 0
    assert main(["generate", "--kv-tiers", "{host_blocks: 8}", "--max-tokens", "2"]) == 2
    assert "--kv-tiers must be JSON" in capsys.readouterr().err
    assert main(["generate", "--kv-tiers", '{"host_blocks": 8, "hash_key": "zz"}', "--max-tokens", "2"]) == 2
    assert "kv_tiers.hash_key as a string must be hex" in capsys.readouterr().err


def test_pd_proxy_refuses_a_bad_server_url(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("httpx")
    assert main(["pd-proxy", "--prefill", "localhost:8100", "--decode", "http://127.0.0.1:8200"]) == 2
    assert "must start with http" in capsys.readouterr().err


def test_pd_proxy_servers_add_up_whether_listed_or_repeated() -> None:
    from deepinfer_kit.cli import build_parser

    args = build_parser().parse_args(["pd-proxy", "--prefill", "http://a", "--prefill", "http://b", "http://c",
                                      "--decode", "http://d", "--decode", "http://e"])
    assert args.prefill == ["http://a", "http://b", "http://c"] and args.decode == ["http://d", "http://e"]
