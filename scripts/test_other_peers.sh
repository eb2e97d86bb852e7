#!/usr/bin/env bash
# The transformers adapter's tests (and its example) on the tested release the lock does not
# pin (requirements/transformers-other.txt, installed by scripts/setup.sh), put ahead of the
# venv's own transformers on the path. CI runs it after the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
other=.venv/peers/transformers-other
[ -d "$other" ] || { echo "$other is missing: run bash scripts/setup.sh" >&2; exit 1; }
PYTHONPATH="$other" .venv/bin/python -c 'import transformers; print("transformers", transformers.__version__)'
PYTHONPATH="$other" .venv/bin/pytest -p no:cacheprovider -q \
    tests/adapters/test_adapter_transformers.py "tests/test_examples.py::test_example_runs[inside_transformers]"
