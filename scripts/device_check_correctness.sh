#!/usr/bin/env bash
# GPU correctness in one run of at most 5 minutes on a cold machine (empty Triton cache).
# Run from the repository root:
#
#     OUT=/tmp/out bash scripts/device_check_correctness.sh     # logs under $OUT (4 files)
#
# 1. pre-flight (45 s): torch sees a GPU, triton / transformers / pytest import; which
#    optional packages (pytest-xdist, hypothesis) are there.
# 2. the cuda tier (240 s): every test marked `cuda`, with the Triton interpreter off, so
#    the kernels compile for the device and run against their torch references
#    (tests/engine/test_kernels_native.py and the cuda tests beside each kernel's CPU
#    tests); the differential engine runs, captured vs eager decode token for token on the
#    embedded MoE model and a dense Qwen3 in fp32 and bf16 plus a two-layer Qwen3-1.7B-shaped
#    bf16 model (tests/engine/test_cuda_graphs.py), with the compile counter
#    (deepinfer_kit.engine.runner.kernel_keys.compiled_variants) that must not move after warm-up.
#    Only the files holding cuda tests are collected, and a collection error (a missing
#    optional package) fails its file, not the run. pytest-xdist spreads the tests over 8
#    workers when installed (Triton compiles on the CPU; its disk cache is shared).
# Every step runs under `timeout -k`, so the script ends inside its budget and exits non-zero
# when a step failed. Needs torch with CUDA, triton, transformers, pytest (PYTHONPATH=src).
set -u
OUT=${OUT:-/tmp/device_check_correctness}
# shellcheck source=device_check_lib.sh
. "$(dirname "$0")/device_check_lib.sh"
step preflight 45 python - <<'PY'
import importlib.util
import torch, triton, transformers, pytest, deepinfer_kit  # noqa: F401
assert torch.cuda.is_available(), "torch sees no CUDA device"
print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())
for optional in ("xdist", "hypothesis"):
    print(optional, "present" if importlib.util.find_spec(optional) else "MISSING (optional)")
PY
[ $? -eq 0 ] || { echo "pre-flight failed: nothing else run" | tee -a "$OUT/summary.txt"; exit 1; }

mapfile -t files < <(grep -rlE "pytest\.mark\.cuda|mark\.cuda\b" tests --include='test_*.py' | sort)
workers=()
if python -c "import xdist" 2>/dev/null; then workers=(-n 8 --dist load); fi
step cuda_tier 240 python -m pytest -q -o addopts="-ra --strict-markers" -m cuda \
    -p no:cacheprovider --continue-on-collection-errors "${workers[@]}" "${files[@]}"

if [ ${#failed[@]} -gt 0 ]; then
    echo "failed: ${failed[*]}" | tee -a "$OUT/summary.txt"
    exit 1
fi
echo "all correctness checks passed" | tee -a "$OUT/summary.txt"
