"""A step's layout and launch read nothing back from the device, so on CUDA the host can
queue step k + 1 while step k's forward runs (the runner's two phases): every serving
row kind (greedy, top-p, top-k with top-p and min-p, logprobs, prompt logprobs, logit
bias, allowed ids, bad words, forks, penalties with ``min_tokens``, a structured-output
grammar) on the static decode
path of an overlapped EPLB engine with dispatch-time balancing, rebalancing on the way,
whose rounds are traced. CPU stand-in for ``torch.cuda.set_sync_debug_mode("error")``: every
kernel on Triton (the interpreter), ops checked by :class:`host_reads.DeviceReads`."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from differential import run_workload
from host_reads import DeviceReads
from static_rounds import record_static_rounds

from deepinfer_kit import SamplingParams, build_engine
from deepinfer_kit.engine.runner.model_runner import ModelRunner
from deepinfer_kit.engine.trace import StepTrace

pytestmark = pytest.mark.triton

P = SamplingParams
KINDS = [
    P(temperature=0.0, max_tokens=4),
    P(temperature=0.7, top_p=0.8, max_tokens=4, seed=1),
    P(temperature=0.7, min_p=0.1, max_tokens=4, seed=2, logprobs=0),
    P(temperature=1.0, logprobs=5, top_k=3, max_tokens=4, seed=3),
    P(temperature=0.0, prompt_logprobs=2, max_tokens=2),
    P(temperature=0.9, logit_bias={5: 3.0, 9: -2.0}, top_k=50, max_tokens=4, seed=4),
    P(temperature=0.9, allowed_token_ids=[3, 4, 5, 6], max_tokens=4, seed=5),
    P(temperature=0.9, bad_words_token_ids=[[7], [8, 9]], max_tokens=4, seed=6),
    P(temperature=1.0, n=2, top_k=20, top_p=0.9, max_tokens=4, seed=7),
    P(temperature=0.9, presence_penalty=0.5, repetition_penalty=1.2, min_tokens=2, max_tokens=4, seed=8),
    *([P(temperature=0.9, max_tokens=4, seed=9, structured_outputs={"regex": "[a-z]{2,5}"})]
      if importlib.util.find_spec("xgrammar") else []),  # a grammar's bitmask: built on the host
]
REQUESTS = [(f"x{i}", [3 + i, 17, 29, 3 + i, 17] * (1 + i % 3), p) for i, p in enumerate(KINDS)]
TRITON = {"attention_impl": "triton", "sampler_impl": "triton", "moe_impl": "triton", "num_blocks": 100,
          "block_size": 8, "max_num_seqs": 8, "max_num_batched_tokens": 32, "max_model_len": 64}
EPLB = {"window": 3, "interval": 2, "num_redundant": 4, "num_gpus": 4, "dispatch": "balanced"}


def test_layout_and_launch_read_nothing_back(monkeypatch: pytest.MonkeyPatch) -> None:
    config = {"static_decode": True, "overlap": True, "eplb": EPLB}
    guard = DeviceReads()
    calls = {"prepare": 0, "launch": 0}
    for name in calls:
        original = getattr(ModelRunner, name)

        def guarded(self: ModelRunner, *args: Any, _original: Any = original, _name: str = name,
                    **kwargs: Any) -> Any:
            calls[_name] += 1
            with guard:
                return _original(self, *args, **kwargs)

        monkeypatch.setattr(ModelRunner, name, guarded)
    traces: list[StepTrace] = []
    engine = build_engine(**TRITON, **config, trace=traces.append)
    static_rounds = record_static_rounds(engine)
    got, _ = run_workload(REQUESTS, engine=engine)
    assert not guard.reads, "host reads of device memory:\n" + "\n".join(
        f"{n} x {op} at {site}" for (op, site), n in guard.reads.items())
    assert calls["launch"] >= 5 and calls["prepare"] == calls["launch"]
    assert sorted(got) == sorted(rid for rid, _, _ in REQUESTS)
    assert all(reason in ("length", "stop") for outs in got.values() for _, reason, _ in outs)
    assert traces and all(t.expert_counts is not None and t.slot_counts is not None
                          for t in traces if t.num_batched_tokens)
    assert engine.balancer is not None and engine.balancer.history  # rebalanced on the way
    assert static_rounds, "the static path never ran"
