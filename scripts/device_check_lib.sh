# Shared by the device-check scripts (sourced, not run): the output folder, the environment,
# and `step NAME SECONDS COMMAND...`, which runs one check under `timeout -k`, logs it to
# $OUT/NAME.log, appends its exit code, time and log tail to $OUT/summary.txt and records a
# failure in `failed`. The sourcing script sets OUT before sourcing.
#
# $PYTHON (default python3) runs every step. One Triton cache, $TRITON_CACHE_DIR (default
# /tmp/deepinfer-triton-cache), serves every step of both scripts: a kernel variant compiled
# by one step (or one pytest-xdist worker) is loaded from disk by the next instead of compiled
# again, which is most of a cold step's time.
mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/deepinfer-triton-cache}
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}
mkdir -p "$TRITON_CACHE_DIR"
PYTHON=${PYTHON:-python3}
unset TRITON_INTERPRET  # kernels compile for the device
failed=()

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*" | tee -a "$OUT/summary.txt"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "   rc=$rc in $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
    [ "$rc" -eq 0 ] || failed+=("$name")
    tail -n 25 "$OUT/$name.log" >>"$OUT/summary.txt"
    return "$rc"
}

{ nvidia-smi; "$PYTHON" --version; } >"$OUT/env.txt" 2>&1
