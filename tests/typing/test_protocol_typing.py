"""mypy --strict accepts components that honour a Protocol and rejects ones that break it."""

from __future__ import annotations

from pathlib import Path

import pytest

mypy_api = pytest.importorskip("mypy.api")

CASES = Path(__file__).parent / "cases"
ROOT = Path(__file__).resolve().parents[2]

EXPECTED_ERRORS = {
    "bad_sampler_return.py": 'incompatible types in assignment (expression has type "type[TensorSampler]"',
    "bad_router_missing.py": 'incompatible types in assignment (expression has type "type[HalfRouter]"',
    "bad_executor_args.py": 'incompatible types in assignment (expression has type "type[WrongExecutor]"',
    "bad_batching_policy.py": 'incompatible types in assignment (expression has type "type[ForgetfulBatching]"',
    "bad_runner_slots.py": 'incompatible types in assignment (expression has type "type[ForgetfulRunner]"',
    "bad_verifier_padded.py": 'incompatible types in assignment (expression has type "type[PaddedVerifier]"',
}
GOOD = ["good_sampler.py", "good_scheduler_policy.py", "good_verifier.py"]


def _mypy(*names: str) -> tuple[str, int]:
    args = ["--strict", "--no-error-summary", "--hide-error-context", "--show-error-codes"]
    args += ["--cache-dir", str(ROOT / ".mypy_cache"), "--python-version", "3.10"]
    stdout, stderr, status = mypy_api.run(args + [str(CASES / n) for n in names])
    return stdout + stderr, status


def test_conforming_components_pass_mypy_strict() -> None:
    output, status = _mypy(*GOOD)
    assert status == 0, output


@pytest.mark.parametrize("name", sorted(EXPECTED_ERRORS))
def test_broken_component_fails_mypy_strict(name: str) -> None:
    output, status = _mypy(name)
    assert status == 1, f"mypy accepted {name}:\n{output}"
    lines = [line for line in output.splitlines() if "error:" in line]
    assert len(lines) == 1, output
    assert EXPECTED_ERRORS[name].lower() in lines[0].lower(), output
    assert "[assignment]" in lines[0], output
