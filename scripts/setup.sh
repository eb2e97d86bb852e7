#!/usr/bin/env bash
# The test environment, as the README and CI (.ci/run) install it, in .venv:
#  1. the CPU build of torch first (on this disk; any other resolution pulls a CUDA build);
#  2. the project with its dev extra, through the lock (requirements/lock.txt), so CI, a
#     newcomer and a developer get the same versions;
#  3. unless --no-peers: vLLM's host classes (requirements/vllm-host.txt, ~1 GB unpacked),
#     without dependencies, in .venv/peers/vllm, appended to the venv's sys.path, so the vLLM
#     adapter tests run; and the other tested transformers release in
#     .venv/peers/transformers-other (scripts/test_other_peers.sh runs the adapter on it).
# PYTHON picks the interpreter (default python3; the lock was resolved on CPython 3.11).
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python3}" -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -c requirements/lock.txt -e ".[dev]"
if [ "${1:-}" != "--no-peers" ]; then
    .venv/bin/pip install -q --no-deps --upgrade --target .venv/peers/vllm -r requirements/vllm-host.txt
    site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # Appended after site-packages: the venv's own packages win where both hold one.
    echo "$PWD/.venv/peers/vllm" > "$site/deepinfer_kit_peers.pth"
    .venv/bin/pip install -q --no-deps --upgrade --target .venv/peers/transformers-other \
        -r requirements/transformers-other.txt
fi
