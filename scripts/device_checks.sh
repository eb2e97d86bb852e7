#!/usr/bin/env bash
# Every GPU check in one run, for a session lent a CUDA machine (its device time is short:
# one start, one script). Run from the repository root:
#
#     OUT=/tmp/out bash scripts/device_checks.sh        # logs under $OUT
#
# Order: what only a GPU can show first (the cuda tier, the Triton kernels compiled
# natively), then the GPU benchmarks (overlap on a CUDA stream, decode against the
# roofline, the engine workload), then the default suite (it must pass there too: no test
# may hand CPU tensors to a compiled kernel). Each step has its own time limit, so one
# that hangs costs only its share; the script always reaches the end and exits non-zero
# when any step failed. Needs torch with CUDA, triton, transformers, pytest; no mypy
# (PYTHONPATH=src is enough). Budget: ~9 minutes in all.
set -u
OUT=${OUT:-/tmp/device_checks}
mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
unset TRITON_INTERPRET  # kernels compile for the device
failed=()

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*" | tee -a "$OUT/summary.txt"
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "   rc=$rc in $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
    [ "$rc" -eq 0 ] || failed+=("$name")
    tail -n 15 "$OUT/$name.log" >>"$OUT/summary.txt"
}

nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
python -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" \
    >"$OUT/versions.txt" 2>&1
step cuda_tier 150 python -m pytest -q -m cuda -p no:cacheprovider
step kernels_native 90 python -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/engine/test_spec_triton_verify.py
step bench_overlap 90 python benchmarks/bench_overlap.py --device cuda
step bench_decode 90 python benchmarks/bench_decode.py --device cuda --small
step bench_engine 60 python benchmarks/bench_engine.py --device cuda --overlap --num-requests 32
step default_suite 240 python -m pytest -q -x -p no:cacheprovider
if [ ${#failed[@]} -gt 0 ]; then
    echo "failed: ${failed[*]}" | tee -a "$OUT/summary.txt"
    exit 1
fi
echo "all device checks passed" | tee -a "$OUT/summary.txt"
