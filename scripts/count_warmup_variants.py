"""How many Triton kernel variants an engine's warm-up compiles, counted on a CPU, and what
one cold compile for sm_90 costs here: the figures the device checks' step limits are
sized from (scripts/device_check_*.sh).

    .venv/bin/python scripts/count_warmup_variants.py            # both configurations
    .venv/bin/python scripts/count_warmup_variants.py --no-long  # the short one only (15 s)
    # then serve tests/differential.py's workload(1, 24) on the short engine in bf16 (the
    # dtype of test_cuda_graphs.py::test_no_triton_compilation_after_warm_up) and list
    # every key it launches that warm-up did not (a compile inside a step on the GPU):
    .venv/bin/python scripts/count_warmup_variants.py --no-long --dtype bfloat16 --workload 1

Runs warm-up under the Triton interpreter with every kernel on Triton and the attention's
split target of a 132-SM GPU (an H200), recording each launch's specialisation key with
Triton's own binder (``kernel_keys.record_launches``): one key is one compiled variant on
the GPU. Then compiles two kernels for sm_90 with an empty Triton cache and times them
(needs ptxas, shipped with triton). The long configuration runs the interpreter over
4096-token contexts and takes about four minutes on a 2-core machine. ``--workload``
adds a few minutes per seed. Launches that run a Triton kernel only on a CUDA device
(``sample.logprobs.row_logsumexp``) take their torch path here: warm-up launches
their keys through the sampler's ops as well.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from deepinfer_kit import build_engine  # noqa: E402
from deepinfer_kit.engine.runner import static_decode  # noqa: E402
from deepinfer_kit.engine.runner import warmup  # noqa: E402
from deepinfer_kit.engine.runner.kernel_keys import record_launches  # noqa: E402
from deepinfer_kit.models.attention import splits  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from differential import run_workload, workload  # noqa: E402

H200_TARGET = 2 * 132
TRITON = {"attention_impl": "triton", "sampler_impl": "triton", "moe_impl": "triton", "static_decode": True}
CONFIGS = {
    "short (max_model_len 96, 16 seqs: the cuda tests' engines)":
        {"num_blocks": 200, "block_size": 8, "max_model_len": 96, "max_num_seqs": 16, "max_num_batched_tokens": 96},
    "long (max_model_len 4096, 4 seqs: the context-bucket test)":
        {"num_blocks": 1200, "block_size": 8, "max_model_len": 4096, "max_num_seqs": 4, "max_num_batched_tokens": 4096},
}

COMPILE = """
import time, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from deepinfer_kit.models.attention import triton_ops as attn
from deepinfer_kit.sample import triton_ops as sample
attn_sig = ("q_ptr:*bf16 k_ptr:*bf16 v_ptr:*bf16 out_ptr:*bf16 part_out_ptr:*fp32 part_ml_ptr:*fp32 "
    "tables_ptr:*i64 qstart_ptr:*i64 seqlen_ptr:*i64 sm_scale:fp32 q_st:i32 q_sh:i32 k_sb:i32 k_sp:i32 "
    "k_sh:i32 v_sb:i32 v_sp:i32 v_sh:i32 o_st:i32 o_sh:i32 table_stride:i32 num_m_tiles:i32")
attn_c = dict(NUM_HQ=16, GROUPS=2, HEAD_DIM=128, PAGE=16, NUM_SPLITS=4, BLOCK_M=16, BLOCK_N=64,
              BLOCK_D=128, PRECISION=None)
draw_sig = ("vals_ptr:*fp32 idx_ptr:*i64 inv_t_ptr:*fp32 k_ptr:*i64 p_ptr:*fp64 min_p_ptr:*fp32 "
    "z_ptr:*fp64 u_ptr:*fp64 tok_ptr:*i64 kept_ptr:*i64 W:i32")
for fn, sig, consts in ((attn._paged_attn_kernel, attn_sig, attn_c), (sample._candidate_kernel, draw_sig, dict(BLOCK=64))):
    s = dict(item.split(":") for item in sig.split())
    s.update({k: "constexpr" for k in consts})
    t = time.perf_counter()
    triton.compile(ASTSource(fn=fn, signature=s, constexprs=consts), target=GPUTarget("cuda", 90, 32))
    print(f"{fn.__name__}: {time.perf_counter() - t:.2f} s")
"""


def count(config: dict[str, int], dtype: str = "auto", seeds: tuple[int, ...] = ()
          ) -> tuple[int, dict[str, int], dict[str, set[str]]]:
    """Distinct launch keys of one engine's warm-up, in all and per kernel; then, per seed,
    serve ``workload(seed, 24)`` on that engine: the keys it launched that warm-up did
    not, per kernel (each one a compilation inside a step on a GPU)."""
    engine = build_engine(**TRITON, **config, dtype=dtype)
    with record_launches() as keys:
        warmup.warm_up(engine.runner, max_num_seqs=config["max_num_seqs"],
                       max_num_batched_tokens=config["max_num_batched_tokens"],
                       max_model_len=config["max_model_len"], capture=False)
    per: dict[str, set[str]] = {}
    for name, key in keys:
        per.setdefault(name.rsplit(".", 1)[-1], set()).add(key)
    added: dict[str, set[str]] = {}
    vocab = engine.runner.model.config.vocab_size
    for seed in seeds:
        with record_launches() as served:
            run_workload(workload(seed, 24, min(vocab, 250)), engine=engine)
        for name, key in set(served) - set(keys):
            added.setdefault(name, set()).add(key)
    return sum(len(v) for v in per.values()), {k: len(v) for k, v in sorted(per.items())}, added


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-long", action="store_true", help="skip the 4096-token configuration")
    parser.add_argument("--dtype", default="auto", help="the engines' dtype (the cuda tests: bfloat16)")
    parser.add_argument("--workload", default="", metavar="SEEDS",
                        help="comma-separated seeds of tests/differential.py workloads to serve "
                             "after warm-up on the short configuration")
    args = parser.parse_args()
    seeds = tuple(int(s) for s in args.workload.split(",") if s)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    for target in (warmup, static_decode, splits):
        target.split_target = lambda device: H200_TARGET  # type: ignore[attr-defined]
    for name, config in CONFIGS.items():
        if args.no_long and "long" in name:
            continue
        t = time.perf_counter()
        total, per, added = count(config, args.dtype, seeds if "short" in name else ())
        print(f"{name}: {total} variants ({time.perf_counter() - t:.0f} s here)")
        print("   " + ", ".join(f"{k} {v}" for k, v in per.items()))
        if seeds and "short" in name:
            print(f"   workload(s) {args.workload} then launched {sum(map(len, added.values()))} "
                  f"keys warm-up did not")
            for kernel, new in sorted(added.items()):
                print("\n".join(f"     {kernel}: {key}" for key in sorted(new)))
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as cache:
        env.update(TRITON_CACHE_DIR=cache, TRITON_DEFAULT_FP_FUSION="1")
        done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True)
    print("cold sm_90 compiles here:", done.stdout.strip().replace("\n", "; ") or done.stderr[-500:])


if __name__ == "__main__":
    main()
