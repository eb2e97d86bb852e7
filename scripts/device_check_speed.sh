#!/usr/bin/env bash
# GPU speed in one run of at most 5 minutes on a cold machine (empty Triton cache). Run
# from the repository root:
#
#     OUT=/tmp/out bash scripts/device_check_speed.sh     # logs under $OUT (6 files)
#
# 1. pre-flight (45 s): torch sees a GPU; triton and transformers import.
# 2. bench_decode (130 s): the Qwen3-1.7B shape in bf16 (random weights), batch 1 and 64,
#    64 new tokens, best of 2; the engine's decode ms per step against the HBM roofline
#    measured in the same run ("of roofline") and against transformers (sdpa). Targets:
#    batch 1 >= 60% of the roofline, batch 64 >= 10x transformers.
# 3. bench_engine --device cuda (60 s): 32 requests on the small Qwen3-MoE against the best
#    transformers generate configuration (target >= 2x), identical greedy tokens.
# 4. bench_overlap --quick (50 s): two rows of the host-time sweep (host work 0.5x and 2x a
#    fixed device time) and the embedded model's serving row, overlapped (CUDA stream, worker
#    process) vs synchronous engines on the GPU, tokens identical.
# Every step runs under `timeout -k`; the script exits non-zero when a step failed.
set -u
OUT=${OUT:-/tmp/device_check_speed}
# shellcheck source=device_check_lib.sh
. "$(dirname "$0")/device_check_lib.sh"
step preflight 45 python -c "
import torch, triton, transformers, deepinfer_kit
assert torch.cuda.is_available(), 'torch sees no CUDA device'
print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"
[ $? -eq 0 ] || { echo "pre-flight failed: nothing else run" | tee -a "$OUT/summary.txt"; exit 1; }

step bench_decode 130 python benchmarks/bench_decode.py --device cuda --batch-sizes 1 64 \
    --new-tokens 64 --repeats 2 --hf-attn sdpa
step bench_engine 60 python benchmarks/bench_engine.py --device cuda --num-requests 32 \
    --batch-sizes 32
step bench_overlap 50 python benchmarks/bench_overlap.py --device cuda --quick

if [ ${#failed[@]} -gt 0 ]; then
    echo "failed: ${failed[*]}" | tee -a "$OUT/summary.txt"
    exit 1
fi
echo "all speed checks ran" | tee -a "$OUT/summary.txt"
