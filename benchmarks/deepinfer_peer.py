"""DeepInfer (DeepSeek's ``deepinfer`` 0.1.0) as a peer in the benchmarks, loaded from a
local copy of its source distribution — nothing of it is copied into this repository.

Where the sdist lies: ``--deepinfer PATH`` of the benchmark, else ``$DEEPINFER_SRC``, else
``/tmp/deepinfer/deepinfer-0.1.0`` (what ``bash ../shared/tools/get-deepinfer.sh``
unpacks; ``pip download --no-deps deepinfer==0.1.0`` fetches it elsewhere). Without one
the benchmarks print a line saying so and leave DeepInfer's rows out.

- :func:`load_planner`: its verify-length rule, ``MTPVarlen::schedule`` of
  ``csrc/engine/mtp_varlen.hpp``, compiled unchanged with ``c++`` into a small shared
  library beside a stub ``sequence.hpp`` (only the fields the rule reads) and called
  through ``ctypes``. The compiled library is cached under the system temp directory.
- :func:`load_eplb`: its placement policy, ``rebalance_experts_global`` of
  ``deepinfer/model_executor/eplb/policy.py`` (pure torch), imported by file path.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import torch

DEFAULT = Path("/tmp/deepinfer/deepinfer-0.1.0")

_STUB = """#pragma once
#include <stdexcept>
#include <vector>
// the fields of DeepInfer's Sequence / MtpState that MTPVarlen::schedule reads
#define TORCH_CHECK(cond, ...) do { if (!(cond)) throw std::runtime_error("TORCH_CHECK failed: " #cond); } while (0)
struct MtpState {
    std::vector<int> draft_tokens;
    std::vector<float> accept_rates;
    std::vector<float> prev_accept_rates;
    bool has_draft_info{false};
    int process_cnt{0};
    int schedule_cnt{0};
};
struct Sequence { MtpState mtp; };
"""

_SHIM = """#include "mtp_varlen.hpp"
#include <memory>
extern "C" int deepinfer_schedule(int n_curve, const int *sizes, const float *ms, int num_seqs,
                                  const int *num_drafts, const float *rates, const float *prev_rates,
                                  int *seqlens) {
    try {
        MTPVarlen planner;
        std::vector<std::pair<int, float>> curve;
        for (int i = 0; i < n_curve; ++i) curve.emplace_back(sizes[i], ms[i]);
        planner.set_decode_perf_curve(curve);
        std::vector<std::shared_ptr<Sequence>> seqs;
        int at = 0;
        for (int i = 0; i < num_seqs; ++i) {
            auto s = std::make_shared<Sequence>();
            int nd = num_drafts[i];
            s->mtp.draft_tokens.assign(nd, 0);
            s->mtp.accept_rates.assign(rates + at, rates + at + nd);
            s->mtp.prev_accept_rates.assign(prev_rates + at, prev_rates + at + nd);
            s->mtp.has_draft_info = nd > 0;
            at += nd;
            seqs.push_back(s);
        }
        std::vector<int> out;
        planner.schedule(seqs, out);
        for (int i = 0; i < num_seqs; ++i) seqlens[i] = out[i];
        return 0;
    } catch (...) {
        return 1;
    }
}
"""


def find_sdist(path: str | None = None) -> Path | None:
    """The unpacked sdist (the folder holding ``csrc/`` and ``deepinfer/``): ``path``, else
    ``$DEEPINFER_SRC``, else :data:`DEFAULT`; ``None`` when none of them holds it."""
    for candidate in (path, os.environ.get("DEEPINFER_SRC"), str(DEFAULT)):
        if candidate and (Path(candidate) / "csrc" / "engine" / "mtp_varlen.hpp").is_file():
            return Path(candidate)
    return None


def missing(path: str | None = None) -> str:
    """The line a benchmark prints when the sdist is absent."""
    return (f"DeepInfer rows skipped: no deepinfer 0.1.0 sdist at {path or os.environ.get('DEEPINFER_SRC') or DEFAULT} "
            f"(unpack it there, set DEEPINFER_SRC or pass --deepinfer PATH)")


class DeepInferSchedule:
    """``MTPVarlen::schedule`` as a Python call: the profiled curve ``(graph size,
    milliseconds)`` and, per sequence, this round's and the previous round's cumulative
    accept rates (survivals); returns the tokens each sequence verifies in the round
    (``1 + drafts``). Without the online estimators (they start empty: no slope, no
    sampler time), as at the start of serving."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.deepinfer_schedule
        self._fn.restype = ctypes.c_int

    def __call__(self, curve: Sequence[tuple[int, float]], rates: Sequence[Sequence[float]],
                 prev_rates: Sequence[Sequence[float]]) -> list[int]:
        n = len(rates)
        nd = [len(r) for r in rates]
        if [len(p) for p in prev_rates] != nd:
            raise ValueError("rates and prev_rates must have the same length per sequence")
        flat = [float(a) for r in rates for a in r]
        prev = [float(a) for r in prev_rates for a in r]
        out = (ctypes.c_int * max(1, n))()
        rc = self._fn(len(curve), (ctypes.c_int * len(curve))(*[s for s, _ in curve]),
                      (ctypes.c_float * len(curve))(*[m for _, m in curve]), n,
                      (ctypes.c_int * max(1, n))(*nd), (ctypes.c_float * max(1, len(flat)))(*flat),
                      (ctypes.c_float * max(1, len(prev)))(*prev), out)
        if rc:
            raise RuntimeError("MTPVarlen::schedule failed a check")
        return list(out[:n])


def load_planner(root: Path) -> DeepInferSchedule | None:
    """Compile (once; cached by the header's hash) and load DeepInfer's schedule rule, or
    ``None`` when no C++ compiler is found."""
    header = (root / "csrc" / "engine" / "mtp_varlen.hpp").read_bytes()
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return None
    build = Path(tempfile.gettempdir()) / f"deepinfer_kit_peer_{hashlib.sha256(header).hexdigest()[:16]}"
    lib = build / "libmtp_varlen.so"
    if not lib.is_file():
        build.mkdir(parents=True, exist_ok=True)
        (build / "mtp_varlen.hpp").write_bytes(header)
        (build / "sequence.hpp").write_text(_STUB)
        (build / "shim.cpp").write_text(_SHIM)
        tmp = build / f"lib.{os.getpid()}.so"
        subprocess.run([compiler, "-O2", "-std=c++17", "-shared", "-fPIC", "-I", str(build),
                        str(build / "shim.cpp"), "-o", str(tmp)], check=True, capture_output=True)
        tmp.replace(lib)
    return DeepInferSchedule(ctypes.CDLL(str(lib)))


def load_eplb(root: Path) -> Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """DeepInfer's ``rebalance_experts_global(tokens_per_expert [S, L, E], num_physical,
    num_local_physical) -> (physical_to_logical [L, P], logical_to_physical, logical_count)``."""
    path = root / "deepinfer" / "model_executor" / "eplb" / "policy.py"
    spec = importlib.util.spec_from_file_location("_deepinfer_eplb_policy", path)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn: Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = module.rebalance_experts_global
    return fn
